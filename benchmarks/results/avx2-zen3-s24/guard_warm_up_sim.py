"""The plain guard (AutoSpeculator) on simulated steps: speculative steps earn `gain` x the
tokens a second of plain ones, their first `slow_first` at 1.5x the time, the host speed a
random walk of `walk` a step; the share of steps on the wrong arm after the first 50 (median /
90th percentile of 60 seeds), without and with the warm-up. Run from the repository root:
``python benchmarks/results/avx2-zen3-s24/guard_warm_up_sim.py``."""
import random, sys
sys.path.insert(0, "."); sys.path.insert(0, "tests")
from tokenswift.speculation import AutoSpeculator, StepFacts
from tokenswift.costs import CostModel
from tokenswift.interfaces import Verdict
from tokenswift.tree import DraftTree, DRAFTER, Branch
from test_speculation import calibration

def run(seed, steps=600, gain=1.08, walk=0.03, noise=0.12, warm=0, slow_first=0):
    r = random.Random(seed)
    cm = CostModel(calibration(0.0))
    sp = AutoSpeculator(cm, 8, warm_up=warm)
    speed, total_t, total_tok, picks = 1.0, 0.0, 0, []
    nspec = 0
    for i in range(steps):
        speed = min(max(speed * (1 + r.gauss(0, walk)), 0.6), 1.8)
        f = speed * (1 + r.uniform(-noise, noise))
        proposers = sp.proposers()
        picks.append(bool(proposers))
        if not proposers:
            t = 0.010 * f
            sp.learn(StepFacts(tree=DraftTree.root_only(1), verdict=Verdict(accepted=[], bonus=2), context=64,
                               forward_seconds=t, step_seconds=t, proposing_seconds={}, drafting_pass=None, view_seconds=0.0, emitted=1))
            total_t += t; total_tok += 1
            continue
        tree = DraftTree.root_only(1); tree.add_branch(Branch([7], [0.6]))
        acc = [1] if r.random() < 0.6 else []
        # spec: 1.6 tokens expected for 1.6/gain x the time of a plain step
        t = 0.010 * 1.6 / gain * f * (1.5 if nspec < slow_first else 1.0)
        nspec += 1
        sp.learn(StepFacts(tree=tree, verdict=Verdict(accepted=acc, bonus=2), context=64, forward_seconds=0.8 * t,
                           step_seconds=t, proposing_seconds={DRAFTER: 0.001}, drafting_pass=None, view_seconds=0.0, emitted=1 + len(acc)))
        total_t += t; total_tok += 1 + len(acc)
    return sum(picks[50:]) / (steps - 50), total_tok / total_t / 100


print("---- wrong-arm share (median / p90), first 8 spec steps 1.5x")
for walk in (0.0, 0.02):
    for gain in (1.08, 1.15, 0.95):
        out = []
        for warm in (0, 8):
            res = [run(s, gain=gain, walk=walk, warm=warm, slow_first=8)[0] for s in range(60)]
            wrong = sorted((1 - x) if gain > 1 else x for x in res)
            out.append(f"warm={warm}: {wrong[30]:.2f}/{wrong[54]:.2f}")
        print(f"walk {walk} gain {gain}: " + "  ".join(out))
