"""Issue 72, item 2: does the CPU Adam leaving more cores to the threads that drive the GPU (the main thread and
autograd's) shorten 7b-8l's --grad-accum 4 overlapped step? python3 calls/spare_cores.py SPARE ARGS...: the run's
command line with ADAM_SPARE_CORES set to SPARE before the update compiles."""

import sys

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402

ol.ADAM_SPARE_CORES = int(sys.argv[1])
ol.exit_with(ol.main(sys.argv[2:]))
