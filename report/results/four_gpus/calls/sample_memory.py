"""Every 5 s until killed: the host's MemAvailable and kernel-side memory (/proc/meminfo), and the python processes'
resident sets (VmRSS, RssAnon, RssFile, RssShmem of /proc/PID/status), in GiB, one line each to argv[1]."""

import sys
import time
from pathlib import Path

MEMINFO = ("MemAvailable", "PageTables", "SUnreclaim", "SReclaimable", "KernelStack", "AnonHugePages", "Mlocked")
STATUS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def fields(path, names) -> dict[str, float]:
    """The named kB fields of a /proc file, in GiB."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            out[name] = int(rest.split()[0]) / 2**20
    return out


with open(sys.argv[1], "w") as log:
    while True:
        host = fields("/proc/meminfo", MEMINFO)
        procs = {name: 0.0 for name in STATUS}
        count = 0
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
                if "Name:\tpython" not in text and "Name:\tpt_main" not in text:
                    continue
                for name, value in fields(status, STATUS).items():
                    procs[name] += value
                count += 1
            except OSError:
                continue
        line = " ".join(f"{k} {v:.2f}" for k, v in (host | procs).items())
        log.write(f"{time.strftime('%H:%M:%S')} procs {count} {line}\n")
        log.flush()
        time.sleep(5)
