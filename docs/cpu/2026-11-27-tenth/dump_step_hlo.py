"""Dump the optimized HLO of configs/gpu_1b.py's train step compiled for the H200 on this CPU (deviceless), via
benchmarks/gpu_compile.compile_row: python dump_step_hlo.py EXPERTS OUT.hlo (dropless, slab, scanned, save_moe, batch 16)."""
import sys

import benchmarks.gpu_compile as g

orig = g._kernel_stats
def ks(hlo):
    open(sys.argv[2], "w").write(hlo)
    return orig(hlo)
g._kernel_stats = ks
spec = dict(dispatch="dropless", grouped="slab", experts=int(sys.argv[1]), scan="on", remat="save_moe", n_layers=0,
            batch=16, target=g.TARGET, attention="pallas_flash")
print(g.compile_row(spec))
