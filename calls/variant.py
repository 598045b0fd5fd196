"""Issue 72, item 2: what holds 7b-8l's --grad-accum 4 overlapped step ~50 ms above the step right after a bound round
(no update pending there)? python3 calls/variant.py SPARE GC ARGS...: the run's command line with ADAM_SPARE_CORES set
to SPARE (cores the CPU Adam leaves to the threads that drive the GPU) before the update compiles, and with GC "on"
(Python's default) or "frozen" (gc.freeze() once the trainer is built, so no collection walks the set-up's objects)."""

import gc
import sys

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402

ol.ADAM_SPARE_CORES = int(sys.argv[1])
if sys.argv[2] == "frozen":
    make_trainer = ol.make_trainer

    def frozen_after(*args, **kwargs):  # the trainer built, every object so far out of the collector's reach
        trainer = make_trainer(*args, **kwargs)
        gc.collect()
        gc.freeze()
        return trainer

    ol.make_trainer = frozen_after
ol.exit_with(ol.main(sys.argv[3:]))
