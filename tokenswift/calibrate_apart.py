"""A machine's first calibrations in a process of their own.

The first run of a model on a machine measures what its forwards cost
(:mod:`tokenswift.calibration`) and, with ``compile = "auto"`` and a long run, what
compiled ones do (:func:`tokenswift.compiling.compile_calibration_for`): a KV store of
4K positions, timing buffers, and a compile of the whole decoder. Measured in the run's
own process, what they left stayed resident for the whole run (issue 57: the 100K-token
run on a 2-core AMD EPYC Zen 4 peaked at 4,142 MiB against its bound of 4,016). So where
the model came from a path that a fresh process can load, the measurement runs in a
child process (:data:`CHILD`), which caches its records and exits, and the run loads
them. The start of that run (2K prompt, 100,000 new tokens asked, 300 generated, empty
caches; ``benchmarks/first_run_memory.py``, same machine) peaked at 3,667 MiB measuring in
its own process and 3,498 MiB with the child. The child costs its start and the model's
load (~9 s there), once per machine and model. Where no child can serve (a model
passed in as an object, a ``tiny`` one, a child that failed or cached nothing under the
run's key), the run measures in its own process, as before.

``TOKENSWIFT_CALIBRATE``: ``apart`` (default) or ``here`` (always in the run's process).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

CALIBRATE_ENV = "TOKENSWIFT_CALIBRATE"
CHOICES = ("apart", "here")
# What a child measures: the forward costs, or compiled against eager steps
WHAT = ("forwards", "compile")


def apart_enabled() -> bool:
    """Whether calibrations run in a child process where they can (``TOKENSWIFT_CALIBRATE``)."""
    choice = os.environ.get(CALIBRATE_ENV, "apart").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{CALIBRATE_ENV}={choice!r}: expected one of {list(CHOICES)}")
    return choice == "apart"


def child_spec(runner, sections: Mapping[str, Any] | None = None) -> dict | None:
    """The pipeline spec a child process measures ``runner``'s model with: the ``ar``
    preset over the model's source (:attr:`Runner.source`) and ``sections`` (the run's
    penalty and sampling, which the scoring cost depends on). None where no child can
    load the same model or calibrations run in the run's process."""
    source = getattr(runner, "source", None)
    if source is None or not apart_enabled():
        return None
    return {"preset": "ar", "model": dict(source), **dict(sections or {})}


def measure_apart(spec: Mapping[str, Any], what: str) -> bool:
    """Measure ``what`` (:data:`WHAT`) for the model of ``spec`` in a child process,
    which caches the record; True where the child finished. Its progress and warnings
    go to this process's stderr."""
    if what not in WHAT:
        raise ValueError(f"what={what!r}: expected one of {list(WHAT)}")
    command = [sys.executable, "-c", CHILD, what, json.dumps(spec), str(torch.get_num_threads())]
    env = {**os.environ, CALIBRATE_ENV: "here"}
    logger.info("measuring %s in a process of its own (its memory is released when it exits)", what)
    try:
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False)
    except OSError as exc:
        logger.warning("could not start the calibration process (%s); measuring in this one", exc)
        return False
    if done.returncode != 0:
        logger.warning("the calibration process failed (exit status %d); measuring in this one", done.returncode)
        return False
    return True


def record_from_child(runner, what: str, load, sections: Mapping[str, Any] | None = None):
    """``what`` measured for ``runner`` in a child process and ``load(runner)``'s record
    of it; None where no child can serve, it failed, or it cached nothing under the
    run's key (then the caller measures in its own process)."""
    spec = child_spec(runner, sections)
    if spec is None or not measure_apart(spec, what):
        return None
    record = load(runner)
    if record is None:
        logger.warning("the calibration process cached nothing under this run's key; measuring in this one")
    return record


# The child's program: ``tokenswift calibrate``'s measurement for a run (a command module,
# which may build a pipeline; this runtime module may not import one)
CHILD = (
    "import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(levelname)s:%(name)s:%(message)s'); "
    "from tokenswift.commands.calibrate import measure_for_run; sys.exit(measure_for_run(*sys.argv[1:]))"
)
