"""Issue 72: a run whose plan weighs only one way of a backward in segments. python3 calls/ways.py WAY ARGS...: the
command line ARGS with make_plan's candidates those of WAY alone: "graphs" (a micro-batch at a time, SegmentGraphs)
or "remade" (SegmentInputs, as --remake-segments asks), to measure the way the plan did not take."""

import sys

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402

way = sys.argv.pop(1)
candidates = ol.plan_candidates


def one_way(run):  # the plan's candidates of that way, and every unit keeping its inputs
    return [(n, remake, margin) for n, remake, margin in candidates(run) if n == 1 or remake == (way == "remade")]


ol.plan_candidates = one_way
ol.exit_with(ol.main())
