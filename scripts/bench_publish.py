"""Publishing and taking a version at the sizes of real models, stage by stage, on 1, 2, ... cores.

    .venv/bin/python scripts/bench_publish.py --shape 0.6b --cores 1,2 [--repeats 3] [--json F] [--dir DIR]

Builds two synthetic bf16 versions of a Qwen3 shape (random weights; the second moves ~4 % of its 16-bit words
by one unit in the last place, as one learner step at a small learning rate does), then, in a fresh process
pinned to each core count (`sched_setaffinity`: `spare_cores()` and torch's threads see that many), times every
stage of the learner's publish in the publisher's order and of a worker's take:

  learner   snapshot (the weights into the file's bytes in memory, `VersionImage`, into the last version's
            memory as the publisher does; the first version's, into fresh memory, is shown apart and not counted
            in the publish), then the write (O_DIRECT where the filesystem takes it) on its own thread beside
            the piece hashes, the digest (the whole file's BLAKE3, which the API announces) and the delta
            encode, all from that memory; the torrents (from the hashes) and the seeding
  worker    rebuild (delta -> file, with its digest check), verify (the digest of a full download)
  bound     one plain read and write of a version's file (8 MiB blocks): what any publish must at least do;
            timed twice from a synced disk: into the page cache, and on to the disk (fsync), as the publisher's
            O_DIRECT write goes (a bound taken while the disk still wrote back the last file took 2-4x as long)

and prints each stage's seconds, the speed-up over the fewest cores, and the whole publish against the bound.
Files go to DIR (default: a temporary directory, removed at the end). Shapes 4b and 8b need 8 and 16.4 GB per
version, three versions on disk at once and two in memory (8b: 50 GB of disk, 33 GB of memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {  # Qwen3 configs (config.json of Qwen/Qwen3-*): hidden, intermediate, layers, heads, kv heads, tied
    "tiny": (128, 384, 2, 4, 2, True),  # for the test that the script runs
    "0.6b": (1024, 3072, 28, 16, 8, True),
    "1.7b": (2048, 6144, 28, 16, 8, True),
    "4b": (2560, 9728, 36, 32, 8, True),
    "8b": (4096, 12288, 36, 32, 8, False),
}
VOCAB, HEAD_DIM, CHANGED = 151936, 128, 0.04


def shapes(name: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, layers, heads, kv, tied = SHAPES[name]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (heads * HEAD_DIM, hidden),
            p + "self_attn.k_proj.weight": (kv * HEAD_DIM, hidden),
            p + "self_attn.v_proj.weight": (kv * HEAD_DIM, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (VOCAB, hidden)
    return out


def build(shape: str, root: Path) -> None:
    """v1 and v2 (one step-like change apart) as bf16 safetensors files; the tensors drawn on a thread per core
    (a generator of its own each), each file written from one image of it (an 8b version is 16.4 GB)."""
    from concurrent.futures import ThreadPoolExecutor

    from echo2cli.broadcast.image import VersionImage

    def draw(index: int, dims: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        g = torch.Generator().manual_seed(index)
        t = (torch.randn(dims, generator=g) * 0.02).to(torch.bfloat16)
        rng = np.random.default_rng(index)
        moved = np.flatnonzero(rng.integers(0, 1 << 16, t.numel(), dtype=np.uint16) < int(CHANGED * (1 << 16)))
        return t, moved

    names = list(shapes(shape).items())
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        drawn = list(pool.map(lambda item: draw(item[0], item[1][1]), enumerate(names)))
    v1 = {name: t for (name, _), (t, _) in zip(names, drawn, strict=True)}
    VersionImage(v1).write(root / "v1" / "model.safetensors")
    rng = np.random.default_rng(len(names))
    for t, moved in drawn:  # v2 in place of v1: one version's tensors in memory at a time
        t.view(torch.int16).view(-1)[torch.from_numpy(moved)] += torch.from_numpy(
            rng.choice(np.array([1, -1], np.int16), moved.size)
        )
    VersionImage(v1).write(root / "v2" / "model.safetensors")


def timed(figures: dict[str, float], stage: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    figures[stage] = time.perf_counter() - t0
    return out


def plain_copy(src: Path, dst: Path, to_disk: bool = False) -> None:
    with open(src, "rb") as f, open(dst, "wb") as g:
        while block := f.read(8 << 20):
            g.write(block)
        if to_disk:
            os.fsync(g.fileno())


def write_timed(image, path: Path, t0: float) -> float:
    image.write(path)
    return time.perf_counter() - t0


def one_core_count(root: Path, cores: int) -> dict[str, float]:
    """Every stage in this process, pinned to `cores` cores, as the publisher and a worker run them."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from echo2cli.broadcast.delta import apply_delta, encode_delta
    from echo2cli.broadcast.digest import file_digest
    from echo2cli.broadcast.image import VersionImage
    from echo2cli.broadcast.kernels import warm_up
    from echo2cli.broadcast.node import TorrentNode
    from echo2cli.broadcast.torrent import make_torrent, piece_size_for

    warm_up()  # the learner and the worker compile the delta coder's loops once, at start
    os.sync()  # each run from a quiet disk: not writing back the last run's files
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    torch.set_num_threads(cores)
    out, f = root / f"c{cores}", {}
    weights = load_file(str(root / "v2" / "model.safetensors"))  # the learner's bf16 weights, here on the CPU
    version = out / "v2" / "model.safetensors"
    tracker = "http://127.0.0.1:9/announce"
    node = TorrentNode("127.0.0.1:0")
    base_digest = file_digest(root / "v1" / "model.safetensors")  # known to the publisher from the last version
    try:
        image = timed(f, "first snapshot", VersionImage, weights)  # the first version's, into fresh memory
        t_publish = time.perf_counter()
        image = timed(f, "snapshot", VersionImage, weights, reuse=image)  # every later one's, into the last's
        del weights
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1) as writer:  # the publisher's order: the write beside the rest
            written = writer.submit(write_timed, image, version, t0)
            hashes = timed(f, "piece hashes", image.piece_hashes, piece_size_for(image.nbytes), cores)
            digest = timed(f, "digest", image.digest, cores)
            delta = out / "v2.delta" / "model.delta"
            timed(f, "delta encode", encode_delta, root / "v1" / "model.safetensors", image.words, delta,
                  base_digest=base_digest, target_digest=digest, workers=cores)  # fmt: skip
            f["write (beside them)"] = written.result()
        f["write, hashes, delta: wall"] = time.perf_counter() - t0
        del image
        t0 = time.perf_counter()
        node.seed("full", make_torrent(version.parent, tracker, hashes=hashes).data, out)
        node.seed("delta", make_torrent(delta.parent, tracker).data, out)
        f["torrents + seed"] = time.perf_counter() - t0
        f["publish"] = time.perf_counter() - t_publish
        node.close()
        version.unlink()  # at most three versions on disk at once (an 8b one is 16.4 GB; the lent host has 64 GB)
        for stage, to_disk in (("bound: read + write", False), ("bound: ... to the disk", True)):
            os.sync()  # from a quiet disk, whatever the publish left to write back
            timed(f, stage, plain_copy, root / "v1" / "model.safetensors", out / "copy.bin", to_disk)
            (out / "copy.bin").unlink()
        rebuilt = out / "rebuilt" / "model.safetensors"
        timed(f, "rebuild", apply_delta, root / "v1" / "model.safetensors", delta, rebuilt, digest, base_verified=True)
        timed(f, "verify", file_digest, rebuilt)
    finally:
        node.close()
        shutil.rmtree(out, ignore_errors=True)
    return f | {"bytes": float((root / "v2" / "model.safetensors").stat().st_size)}


def main(a: argparse.Namespace) -> None:
    cores = [int(c) for c in a.cores.split(",")]
    if max(cores) > len(os.sched_getaffinity(0)):
        sys.exit(f"--cores {a.cores}: this machine lets this process use {len(os.sched_getaffinity(0))} cores")
    from echo2cli.broadcast.kernels import COMPILED

    coder = "compiled loops (numba)" if COMPILED else "numpy (numba does not import here: the slower definitions)"
    with tempfile.TemporaryDirectory(prefix="echo2-publish-", dir=a.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        build(a.shape, root)
        size = (root / "v2" / "model.safetensors").stat().st_size
        print(f"shape {a.shape}: {size / 1e9:.2f} GB per bf16 version (built in {time.perf_counter() - t0:.0f} s)")
        print(f"delta coder: {coder}")
        runs: dict[int, list[dict[str, float]]] = {c: [] for c in cores}
        for _ in range(a.repeats):  # the core counts interleaved, so a noisy spell hits them alike
            for c in cores:
                cmd = [sys.executable, __file__, "--one", str(c), "--root", str(root)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"the run on {c} cores failed:\n{proc.stderr[-3000:]}")
                runs[c].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        results = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in cores}
    first = results[cores[0]]
    print(f"{'stage':<24}" + "".join(f"{f'{c} cores s':>12}" for c in cores) + f"{'speed-up':>10}{'GB/s':>8}")
    for stage in [k for k in first if k != "bytes"]:
        row = "".join(f"{results[c][stage]:>12.2f}" for c in cores)
        best = results[cores[-1]][stage]
        print(f"{stage:<24}{row}{first[stage] / best:>10.2f}{size / 1e9 / best:>8.2f}")
    for c in cores:
        r = results[c]
        cache, disk = (r[k] / r["publish"] for k in ("bound: read + write", "bound: ... to the disk"))
        print(f"{c} cores: publish {r['publish']:.2f} s = {cache:.2f} x the bound's speed into the page cache, "
              f"{disk:.2f} x to the disk")  # fmt: skip
    if a.json:
        figures = {"shape": a.shape, "bytes": size, "delta_coder": coder, "cores": results, "runs": runs}
        Path(a.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--cores", default="1,2", help="core counts to run, comma-separated, fewest first")
    p.add_argument("--repeats", type=int, default=1, help="runs per core count; each stage's median is shown")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--dir", help="where the versions are built (default: the system's temporary directory)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_core_count(args.root, args.one)))
    else:
        main(args)
