"""Where the time of the CuTeDSL split-KV decode goes at issue 11's tight shapes, and what the slice count and
tile width do (H200, ~1-2 minutes).

For B=1, Hq=32, Nkv=32768, D=512 bf16 and (Hkv, Nq) in {(2, 4), (2, 1), (8, 16)}: the whole
``ffpa_attn.cute.splitkv.forward`` at S in {32, 64} (the divisors of Nkv near one wave; other counts add a
tail launch) x tile_n in {48, 64, 80}, then at the default S / tile_n the split kernel alone
(``launch_q_broadcast`` on prepared views) and the combine alone (``combine_partials`` on its partials).
CUDA-graph replays over rotating K/V copies (>= 1 GiB, no L2 hits), as in bench/explore_decode.py, whose
copy yardstick (the issue-11 criterion) is measured first. (Run 49's PDL A/B ran this script's ``--pdl`` mode of
commit 44928ab with bench/results/2026-12-01-h200-session8/pdl/pdl.patch applied; the patch was not merged, so the
mode is gone.)

    python bench/explore_decode_slices.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import explore_decode as ed  # noqa: E402

from ffpa_attn.cute import splitkv  # noqa: E402
from ffpa_attn.cute.api import launch_q_broadcast  # noqa: E402
from ffpa_attn.reference import attention  # noqa: E402
from ffpa_attn.testing import rel_err  # noqa: E402
from ffpa_attn.triton.splitkv import combine_partials, sm_count  # noqa: E402

B, HQ, NKV, D = 1, 32, 32768, 512
SHAPES = [(2, 4), (2, 1), (8, 16)]
SLICES = (32, 64)
TILES = (48, 64, 80)


def parts(q, k, v, splits, tile_n):
    """The views and buffers splitkv.forward builds (no tail: splits divides Nkv), and its two steps."""
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    rows = hq // hkv * nq
    qp = q.contiguous().view(b * hkv, rows, d).unsqueeze(0)
    kv = [splitkv._slices(t, splits, NKV // splits) for t in (k, v)]
    po = torch.empty(b * hkv, splits, rows, d, dtype=q.dtype, device=q.device)
    pl = torch.empty(b * hkv, splits, rows, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)

    def kernel():
        launch_q_broadcast(qp, kv[0], kv[1], po.permute(1, 0, 2, 3), pl.permute(1, 0, 2), d ** -0.5, tile_n)

    def combine():
        combine_partials(po, pl, out, lse, hkv=hkv, group=hq // hkv)

    return kernel, combine, out


def main() -> int:
    y = ed.yardsticks()
    ed.print_yardsticks(y)
    for hkv, nq in SHAPES:
        sets, kv_bytes = ed.make_sets(B, HQ, hkv, nq, NKV, D, torch.bfloat16)
        ref = attention(*sets[0], scale=D ** -0.5)[0]
        s0 = splitkv.num_slices(B, hkv, HQ // hkv * nq, NKV, sm_count(sets[0][0].device))
        print(f"\n-- Hkv={hkv} Nq={nq}: K/V {kv_bytes / 1e6:.1f} MB, 75% of COPY = "
              f"{kv_bytes / (0.75 * y['copy']) / 1e3:.1f} us; default S={s0}, tile_n={splitkv.TILE_N}")
        print(f"{'what':<34} {'us':>7} {'%copy':>6} {'rel_err':>8}")
        for s in SLICES:
            for tn in TILES:
                def run(q, k, v, s=s, tn=tn):
                    return splitkv.forward(q, k, v, False, D ** -0.5, splits=s, tile_n=tn)
                err = rel_err(run(*sets[0])[0], ref)
                ms = ed.time_graph([lambda st=st, run=run: run(*st) for st in sets])
                print(f"{'forward S=%d tile_n=%d' % (s, tn):<34} {ms * 1e3:7.1f} "
                      f"{100 * kv_bytes / ms / 1e6 / y['copy']:6.1f} {err:8.1e}", flush=True)
        steps = [parts(*st, s0, splitkv.TILE_N) for st in sets]
        for st in steps:
            st[0]()
            st[1]()
        err = rel_err(steps[0][2], ref)
        k_ms = ed.time_graph([st[0] for st in steps])
        c_ms = ed.time_graph([st[1] for st in steps])
        print(f"{'split kernel alone (default)':<34} {k_ms * 1e3:7.1f} {100 * kv_bytes / k_ms / 1e6 / y['copy']:6.1f} "
              f"{err:8.1e}")
        print(f"{'combine alone (its partials)':<34} {c_ms * 1e3:7.1f}")
        both = ed.time_graph([lambda st=st: (st[0](), st[1]()) for st in steps])
        print(f"{'kernel + combine':<34} {both * 1e3:7.1f} {100 * kv_bytes / both / 1e6 / y['copy']:6.1f}")
        sets = steps = ref = None
        ed._empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
