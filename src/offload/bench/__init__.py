"""`offload bench`: one workload (model or shipped shape, dtype, batch sizes, prompt and
output lengths) through every offloading method side by side in one process, beside the
bounds of this machine measured in the same run.

    from offload.bench import Workload, run_bench, report
    result = run_bench(Workload(batch_sizes=(1, 8)), ["resident", "prefetch-all"])
    print(report.table(result))

The result is JSON: per method and batch a record (tokens/s, step time, bytes offloaded
and moved per forward by link, achieved GB/s, stall, peak memory, same tokens as the
reference, compute per step and the bound), with the machine's limits beside them.
"""

from offload.bench import report
from offload.bench.bound import LINKS, Bound, bound_step
from offload.bench.catalog import METHODS
from offload.bench.results import run_bench
from offload.bench.workload import Workload

__all__ = ["LINKS", "METHODS", "Bound", "Workload", "bound_step", "report", "run_bench"]
