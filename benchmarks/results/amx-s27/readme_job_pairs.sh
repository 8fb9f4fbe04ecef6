#!/bin/bash
# The README's main job, fresh processes, alternating order: default vs --preset ar.
for i in 1 2; do
  if [ $i = 1 ]; then order="default ar"; else order="ar default"; fi
  for p in $order; do
    if [ $p = ar ]; then extra="--preset ar"; else extra=""; fi
    out=/tmp/s27/job-$p-$i.txt
    (cd /tmp && tokenswift generate --max-new-tokens 2000 --seed 0 $extra --stats-json /tmp/s27/job-$p-$i.json > $out) 2> /tmp/s27/job-$p-$i.log
  done
done
