"""Ring-attention scaling over the GPUs of one host: runs tests/gpu/ring_gpu.py under torchrun for each world
size at one global sequence length, then prints the scaling efficiency of each world size W:

    efficiency(W) = T_1(N) / (W * T_W(N))

where T_W(N) is the ring's time per step (forward, and forward + backward) with N global tokens spread over W
GPUs (N / W per rank, zigzag), so 1.0 is perfect scaling. "hidden" is how much of the K/V transfer hides behind
compute: the sum of the steps' compute measured alone divided by the ring's time (1.0 = fully hidden).

    python bench/ring_scaling.py --worlds 1,2,4,8 --n-global 131072          # GQA 32/8, D=512, bf16
    python bench/ring_scaling.py --cpu --worlds 1,2 --n-global 256             # gloo smoke test on a CPU
    python bench/ring_scaling.py --from-json out/ring_w1.json out/ring_w2.json   # re-print saved runs

Each world size first runs the correctness section of ring_gpu.py (ring vs the fp32 reference and the
single-GPU call on the same global inputs) unless --skip-correctness. The JSON of each world size lands in
--out (default ./ring_scaling).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RING = ROOT / "tests" / "gpu" / "ring_gpu.py"


def efficiency_table(runs: list[dict]) -> list[str]:
    """Markdown rows from ring_gpu.py JSONs (one per world size, same global shape)."""
    by_world = {r["world"]: r for r in runs}
    base = by_world.get(1)
    lines = ["| world | causal | N_local | fwd ms | fwd+bwd ms | fwd TFLOPS/GPU | f+b TFLOPS/GPU | efficiency "
             "fwd / f+b | hidden fwd / f+b |", "|---|---|---|---|---|---|---|---|---|"]
    for w in sorted(by_world):
        run = by_world[w]
        for row in run["rows"]:
            eff = "n/a (no world-1 run)"
            if base is not None and base["n_global"] == run["n_global"]:
                b = next(x for x in base["rows"] if x["causal"] == row["causal"])
                eff = f"{b['fwd_ms'] / (w * row['fwd_ms']):.2f} / {b['fwdbwd_ms'] / (w * row['fwdbwd_ms']):.2f}"
            hid = f"{row['sum_steps_fwd_ms'] / row['fwd_ms']:.2f} / {row['sum_steps_fwdbwd_ms'] / row['fwdbwd_ms']:.2f}"
            lines.append(f"| {w} | {row['causal']} | {run['n_local']} | {row['fwd_ms']:.2f} | {row['fwdbwd_ms']:.2f} | "
                         f"{row['fwd_tflops']:.0f} | {row['fwdbwd_tflops']:.0f} | {eff} | {hid} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4,8", help="world sizes to run (default 1,2,4,8; capped at the GPUs)")
    ap.add_argument("--n-global", type=int, default=131072, help="global tokens (default 131072)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--backend", default=None, help="backend for every ring step (default: implicit)")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="gloo + SDPA on CPU (smoke test; tiny shapes)")
    ap.add_argument("--out", default="ring_scaling", help="folder for the per-world JSONs and the table")
    ap.add_argument("--from-json", nargs="*", default=None, help="only re-print the table of saved JSONs")
    a = ap.parse_args(argv)
    if a.from_json:
        runs = [json.loads(Path(p).read_text()) for p in a.from_json]
        print("\n".join(efficiency_table(runs)))
        return 0
    worlds = [int(w) for w in a.worlds.split(",")]
    if not a.cpu:
        import torch

        avail = torch.cuda.device_count()
        if avail == 0:
            print("ring_scaling: no CUDA GPU found (use --cpu for a gloo smoke test)", file=sys.stderr)
            return 2
        worlds = [w for w in worlds if w <= avail]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, rc = [], 0
    for w in worlds:
        js = out / f"ring_w{w}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={w}", str(RING),
               "--n-global", str(a.n_global), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
               "--dim", str(a.dim), "--iters", str(a.iters), "--json", str(js)]
        cmd += ["--backend", a.backend] if a.backend else []
        cmd += ["--cpu"] if a.cpu else []
        cmd += ["--skip-correctness"] if a.skip_correctness else []
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")  # no NVLink multicast
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, env=env)
        rc = rc or r.returncode
        if js.is_file():
            runs.append(json.loads(js.read_text()))
    table = efficiency_table(runs)
    print("\n".join(table))
    (out / "scaling.md").write_text("\n".join(table) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
