"""Target a with AutoParallel's LP bounds of checkpointing candidates on or off.

One process per setting; run the two side by side so the load is shared alike:

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 TORCHALPA_LOG=info /usr/bin/time -v \
        python -u benchmarks/relaxed_bound_ab.py on     # and, beside it, ... off

It prints ``auto_targets.py --targets a``'s report (plan, estimate, the phases' seconds);
``/usr/bin/time``'s user seconds (the forked view workers included) compare the work."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import auto_targets  # noqa: E402

from torchalpa.core.switches import SearchSwitches  # noqa: E402

if len(sys.argv) != 2 or sys.argv[1] not in ("on", "off"):
    sys.exit("usage: relaxed_bound_ab.py on|off")
flag = sys.argv[1] == "on"
sys.argv = ["auto_targets.py", "--targets", "a"]
with SearchSwitches.using(relaxed_bounds=flag):
    auto_targets.main()
