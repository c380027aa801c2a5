"""The cost of the first-use self-check (``fusion_pass.runtime.self_check``), per kernel configuration.

For each head-dim pair of the FA4 kernels of this GPU and each half dtype, the script runs the ``fa4`` backend's
canary (the fused kernel and FA4's forward + the quantizer on the fixed canary batches, every byte compared):

  first     the first canary of the configuration in this process: it compiles the fused kernel and its twin
            (FA4's persistent compile cache may shorten this in later processes) and runs them
  warm      the same canary again, kernels compiled: what the check itself costs (median of ``--repeats``)

Wall-clock seconds around the whole canary (host work, launches, the byte comparison), the GPU synchronized
before and after. A self-check runs once per configuration and process, before the first fused call.

  python bench/self_check.py [--json PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, default=5, help="warm canaries per configuration (default: 5)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be a positive integer, got {args.repeats}")
    if not torch.cuda.is_available():
        print("bench/self_check.py needs a CUDA device (the fa4 backend's canary runs its kernels)", file=sys.stderr)
        return 2
    from fusion_pass.kernels.fa4 import forward
    from fusion_pass.runtime import backends

    device = torch.device("cuda", torch.cuda.current_device())
    backend = backends.get_backend("fa4")
    ok, why = backend.available()
    if not ok:
        print(f"the fa4 backend is unavailable here: {why}", file=sys.stderr)
        return 2
    rows = []
    for d, dv in forward.supported_head_dims(device):
        for dtype in (torch.bfloat16, torch.float16):
            times = []
            for i in range(args.repeats + 1):
                torch.cuda.synchronize()
                started = time.perf_counter()
                passed, detail = backend.canary(device, dtype, 16, d, dv)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
                if not passed:
                    print(f"canary FAILED for ({d}, {dv}) {dtype}: {detail}", file=sys.stderr)
                    return 1
            rows.append({"head_dims": [d, dv], "dtype": str(dtype).replace("torch.", ""), "first_s": times[0],
                         "warm_s": statistics.median(times[1:])})
    name = torch.cuda.get_device_name(device)
    print(f"self-check cost on {name} ({forward.fa4_generation(device)} kernels), {args.repeats} warm repeats")
    print(f"{'head dims':>12} {'dtype':>9} {'first (s)':>10} {'warm (ms)':>10}")
    for row in rows:
        print(f"{str(tuple(row['head_dims'])):>12} {row['dtype']:>9} {row['first_s']:>10.2f} {row['warm_s'] * 1e3:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
