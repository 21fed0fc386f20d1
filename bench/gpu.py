"""The GPU checks in one run (``bench/gpu.sh``); prints one JSON line at the end.

1. ``bnb_4bit``: bitsandbytes NF4 on CUDA works: a model loaded by ``trainer.model.load_base_model``
   and a standalone 4-bit layer, each output compared with a matmul on the dequantized weights.
2. ``throughput``: ours vs TRL-best (``bench/trainer.py``: bf16, BFD packing, TRL on our attention)
   on a randomly initialised ~1B Llama shape and an 8B-shaped slice (Llama-3-8B dims, few layers),
   built offline and registered in a temp catalog: tokens/s after a warm-up step, peak
   ``torch.cuda.max_memory_allocated`` and MFU = the model FLOPs per token of the data
   (``training_flops``: the decoder's linear layers, LoRA, causal attention per example, the head at
   trained positions only) x tokens/s / the device's peak dense bf16 FLOP/s (``PEAK_BF16``, matched
   on the device name). Both contenders on the same attention kernel (``bench/trainer.py``).
2b. ``fsdp_qlora``: the sharded path (``fsdp``) on one device against the same steps unsharded.
3. ``wipe``: the epilog's GPU wipe (``scrubber.gpu.wipe_gpu`` judged by ``scrubber.checks.judge_wipe``)
   with a canary test and a negative control: process A fills all free GPU memory with random words
   carrying a canary and is SIGKILLed; without a wipe, a later process B scans what it can allocate
   for the canary (it should find it, else the test proves nothing); then again with the wipe
   between A and B (B must find none). Also the covered fraction of the GPU's memory.

Every CUDA user is a child process: this one never initialises CUDA, so A and the wipe see the
whole GPU. ``--dry``: on CPU in seconds with tiny shapes, the same code paths in-process, each part
that needs CUDA reported as ``{"not_run": reason}``.

    python bench/gpu.py [--dry] [--repeats 1] [--steps 20] [--budget-s 450]
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import trainer as bt  # noqa: E402
from scrubber import canary  # noqa: E402

# Dense bf16 tensor-core peaks (datasheets), the first name contained in the device name wins.
PEAK_BF16: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
]

LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 32000}
LLAMA3_8B_SLICE = {"hidden_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "intermediate_size": 14336, "vocab_size": 128256}
# Dry mode: the same head ratios, tiny sizes (the vocab must hold make_tiny's 2048 tokens).
DRY_SHAPES = {
    "llama-1b": {**LLAMA_1B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 2048},
    "llama3-8b-slice": {**LLAMA3_8B_SLICE, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                        "num_key_value_heads": 2, "intermediate_size": 448, "vocab_size": 4096},
}
SHAPES = {"llama-1b": LLAMA_1B, "llama3-8b-slice": LLAMA3_8B_SLICE}

Runner = Callable[[Callable[[dict[str, Any]], dict[str, Any]], dict[str, Any]], dict[str, Any]]


def in_process(fn: Callable[[dict[str, Any]], dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """Dry mode's runner: no spawned interpreter (saves its start-up, seconds each)."""
    return fn(job)


def peak_flops(device: str) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s for ``device`` and which table entry gave it (None where none does)."""
    for key, flops in PEAK_BF16:
        if key in device:
            return flops, f"table entry {key!r}: {flops / 1e12:.0f} TFLOP/s dense bf16"
    return None, f"no peak bf16 figure for device {device!r}"


def _decoder_linears(shape: dict[str, int]) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one Llama decoder layer (q, k, v, o, gate, up, down)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def training_flops(shape: dict[str, int], lengths: list[int], trained: int, lora_r: int) -> dict[str, float]:
    """Model FLOPs of one QLoRA training pass over examples of ``lengths`` tokens, ``trained`` of them
    scored, for a Llama of ``shape`` with rank-``lora_r`` LoRA on every decoder linear layer; returns
    each part and ``"total"``. Model FLOPs, not hardware FLOPs: gradient checkpointing's recompute is
    not counted, nor logits a trainer computes at untrained positions (TRL's fused head on a device
    without Triton), nor element-wise work (norms, activations, rotary, softmax).

    - Decoder linear layers (N = their weights; the embeddings are a lookup and the head is counted
      apart): 2N forward + 2N backward per token. The base is frozen, so its backward is only the
      input gradient (2N), not the weight gradient: 4N, not the 6N of full fine-tuning.
    - LoRA (A: in x r, B: r x out on each of those layers): trained, so 6 x its parameters per token
      (forward, input gradient, weight gradient).
    - Attention, per layer and example of length L, causal: L (L + 1) / 2 query-key pairs, each
      2 x heads x head_dim FLOPs for Q K^T and as many for P V; the backward twice the forward.
    - The head (vocab x hidden, frozen) only at the ``trained`` positions: 2 V H forward + 2 V H for
      the input gradient.
    """
    layers, hidden, vocab = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    linears = _decoder_linears(shape)
    tokens = sum(lengths)
    base = layers * sum(i * o for i, o in linears)
    lora = layers * sum(lora_r * (i + o) for i, o in linears)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    parts = {"decoder": 4.0 * base * tokens, "lora": 6.0 * lora * tokens,
             "attention": 3.0 * layers * 4 * heads * head_dim * pairs, "head": 4.0 * vocab * hidden * trained}
    return {**parts, "total": sum(parts.values()), "tokens": float(tokens)}


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOP utilisation: ``flops_per_token`` (``training_flops``' total / its tokens) x tokens/s / peak."""
    return flops_per_token * tokens_per_s / peak if peak else None


# ----------------------------------------------------------------- 1. bitsandbytes 4-bit


def _quant_state(layer: Any) -> Any:
    """A bnb 4-bit layer's quantisation state (an attribute of its ``Params4bit`` weight)."""
    weight: Any = layer.weight
    return weight.quant_state


def _rel_err(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12))


def check_bnb(job: dict[str, Any]) -> dict[str, Any]:
    """Load a model in NF4 and run its first 4-bit layer and a standalone one against dequantized matmuls."""
    bt.quiet()
    import bitsandbytes as bnb
    import torch

    from trainer.model import load_base_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_base_model(job["model"])
    layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    dtype = layer.compute_dtype or torch.float32
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "weight_device": str(layer.weight.device), "quant_type": _quant_state(layer).quant_type,
           "compute_dtype": str(dtype), "model_layer": _layer_vs_dequant(layer, 16, dtype, device)}
    out["standalone"] = _standalone(job["standalone_dim"], dtype, device)
    errors = [out["model_layer"]["rel_err"], *(r["rel_err"] for r in out["standalone"]["rows"].values())]
    out["ok"] = device == "cuda" and out["weight_device"].startswith("cuda") and max(errors) < 2e-2
    if device != "cuda":
        out["not_run"] = "no CUDA device: the NF4 path ran on CPU only"
    return out


def _layer_vs_dequant(layer: Any, rows: int, dtype: Any, device: str) -> dict[str, Any]:
    import bitsandbytes.functional as F
    import torch

    torch.manual_seed(0)
    x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
    with torch.no_grad():
        y = layer(x)
        ref = x @ F.dequantize_4bit(layer.weight.data, _quant_state(layer)).to(dtype).t()
    return {"shape": [rows, layer.in_features, layer.out_features], "rel_err": _rel_err(y, ref)}


def _standalone(dim: int, dtype: Any, device: str) -> dict[str, Any]:
    """A dim x dim NF4 layer from known weights: one row (the gemv kernel) and 64 rows (dequantize + matmul)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    torch.manual_seed(1)
    weight = torch.randn(dim, dim, dtype=dtype) * 0.02
    layer = bnb.nn.Linear4bit(dim, dim, bias=False, compute_dtype=dtype, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    layer = layer.to(device).eval()
    layer.support_avx512bf16_for_cpu = False  # trainer.model.disable_cpu_repack's reason
    deq = F.dequantize_4bit(layer.weight.data, _quant_state(layer)).to(dtype)
    quant_err = float((deq.float().cpu() - weight.float()).pow(2).mean().sqrt() / weight.float().pow(2).mean().sqrt())
    rows = {str(n): _layer_vs_dequant(layer, n, dtype, device) for n in (1, 64)}
    return {"dim": dim, "nf4_rel_rmse_vs_original": quant_err, "rows": rows}


# ----------------------------------------------------------------- 2. throughput


def build_shape(job: dict[str, Any]) -> dict[str, Any]:
    """Build a random Llama of ``job["shape"]`` (bf16) with make_tiny's tokenizer, register it; return job fields."""
    bt.quiet()
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tiny, out = Path(job["tiny"]), Path(job["workdir"]) / f"build-{job['name']}"
    out.mkdir(parents=True)
    for path in tiny.iterdir():  # the tokenizer and chat template
        if path.is_file() and not path.name.startswith(("model", "config", "generation_config")):
            shutil.copyfile(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(**job["shape"], max_position_embeddings=8192, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    return {**bt.register(out, job["name"], Path(job["workdir"])), "params": params}


def long_chats(n: int, turns: int, seed: int) -> list[dict[str, Any]]:
    """``n`` multi-turn chats, each ``turns`` toy exchanges long (GPU rows need longer examples)."""
    from trainer.toydata import toy_conversations

    pieces = toy_conversations(n * turns, seed=seed)
    chats = []
    for i in range(n):
        messages = [m for p in pieces[i * turns:(i + 1) * turns] for m in p["messages"] if m["role"] != "system"]
        chats.append({"messages": [{"role": "system", "content": "You follow instructions."}, *messages]})
    return chats


def throughput(job: dict[str, Any], name: str, run: Runner, repeats: int, flops: float | None) -> dict[str, Any]:
    """Build the shape, alternate ours / TRL-best, return medians, ratios and MFU."""
    built = run(build_shape, {**job, "name": name, "shape": job["shapes"][name]})
    shape_job = {**job, **built}
    memory = "peak_cuda_mb" if job["cuda"] else "peak_rss_mb"
    print(f"== {name}: {built['params']:,} parameters", flush=True)
    results = bt.alternate(shape_job, repeats, False, run)
    summary = bt.report(shape_job, results, memory)
    model_flops = training_flops(job["shapes"][name], job["lengths"], sum(job["trained"]), bt.LORA["r"])
    per_token = model_flops["total"] / model_flops["tokens"]
    for who, m in summary["medians"].items():
        m["mfu"] = mfu(per_token, m["tokens_per_s"], flops)
        print(f"MFU {who}: " + (f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a (no peak figure)")
              + f" ({per_token:.3e} model FLOPs per token of the data)")
    out: dict[str, Any] = {"params": built["params"], "shape": job["shapes"][name], "memory": memory,
                           "step_tokens": job["step_tokens"], "model_flops": model_flops,
                           "flops_per_token": per_token, "runs": results, **summary}
    if not job["cuda"]:
        out["not_run"] = "no CUDA device: tiny shapes on CPU, peak RSS instead of CUDA memory, no MFU"
    return out


# ----------------------------------------------------------------- 2b. FSDP-QLoRA smoke

def fsdp_run(job: dict[str, Any]) -> dict[str, Any]:
    """Train the tiny model with the recipe on one rank, sharded (FSDP2) or not; the loss curve and speed."""
    bt.quiet()
    import torch

    torch.set_num_threads(job["threads"])
    from trainer.contract.spec import parse_spec
    from trainer.recipe import Recipe, StopFlag

    spec = {**bt.our_spec(job), "fsdp": job["fsdp"]}
    recipe = Recipe(parse_spec(spec), 0, StopFlag())
    try:
        recipe.setup()
        recipe.train()
        metrics = recipe.progress.metrics
        return {"fsdp": job["fsdp"], "losses": [m["loss"] for m in metrics],
                "tokens_per_s": sum(m["tokens"] for m in metrics[1:]) / max(
                    metrics[-1]["elapsed_s"] - metrics[0]["elapsed_s"], 1e-9),
                "sharded": recipe.world.sharded}
    finally:
        recipe.cleanup()
        recipe.world.close()


def fsdp_smoke(job: dict[str, Any], run: Runner) -> dict[str, Any]:
    """FSDP-QLoRA end to end on one device (4-bit base in bf16 storage, FSDP2 over a group of one,
    NCCL on CUDA): its loss curve against the same steps unsharded. A single GPU cannot show
    several ranks; tests/trainer/test_trainer_distributed.py does that with gloo on the CPU."""
    plain, sharded = run(fsdp_run, {**job, "fsdp": False}), run(fsdp_run, {**job, "fsdp": True})
    pairs = list(zip(plain["losses"], sharded["losses"], strict=True))
    worst = max(abs(a - b) / max(abs(a), 1e-9) for a, b in pairs)
    print(f"FSDP-QLoRA smoke: {len(pairs)} steps, worst relative loss difference {worst:.2e}, "
          f"{sharded['tokens_per_s']:,.0f} vs {plain['tokens_per_s']:,.0f} tokens/s unsharded", flush=True)
    out: dict[str, Any] = {"steps": len(pairs), "worst_rel_loss_diff": worst, "sharded": sharded["sharded"],
                           "tokens_per_s": {"fsdp": sharded["tokens_per_s"], "plain": plain["tokens_per_s"]}}
    if not job["cuda"]:
        out["not_run"] = "no CUDA device: FSDP2 over gloo on the CPU, not NCCL"
    return out


# ----------------------------------------------------------------- 3. the wipe

WIPE = """
    import json, torch
    from scrubber import checks, gpu
    from scrubber.config import ScrubConfig
    cfg = ScrubConfig()
    r = gpu.wipe_gpu(torch, 0, chunk_bytes=cfg.wipe_chunk_mb << 20, min_chunk_bytes=cfg.wipe_min_chunk_mb << 20)
    v = checks.judge_wipe([r], 1)
    print(json.dumps({"status": str(v.status), "message": v.message, **v.figures,
                      "nonzero_chunks": r.nonzero_chunks}), flush=True)
"""

CHILD_SCRIPTS = {"fill": canary.FILL, "scan": canary.SCAN, "wipe": WIPE}


def _python(script: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(CHILD_SCRIPTS[script]), *args]


def _fill_and_kill(marker: str) -> tuple[int, int]:
    """Process A fills the GPU with canaried words and is SIGKILLed holding it; returns (filled, total) bytes."""
    a = subprocess.Popen(_python("fill", marker), text=True, stdout=subprocess.PIPE, cwd=REPO)  # noqa: S603
    try:
        assert a.stdout is not None
        filled, total = map(int, a.stdout.readline().split())
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    return filled, total


def _scan(marker: str) -> dict[str, int]:
    b = subprocess.run(_python("scan", marker), cwd=REPO, capture_output=True, text=True,  # noqa: S603
                       timeout=300, check=True)
    hits, scanned = map(int, b.stdout.split())
    return {"canary_hits": hits, "scanned_bytes": scanned}


def _wipe() -> dict[str, Any]:
    w = subprocess.run(_python("wipe"), cwd=REPO, capture_output=True, text=True,  # noqa: S603
                       timeout=300, check=True)
    return dict(json.loads(w.stdout.strip().splitlines()[-1]))


def wipe_check(cuda: bool) -> dict[str, Any]:
    """Negative control (A, then B), then the wipe (A, wipe, B); with a fresh canary each time."""
    if not cuda:
        for name, script in CHILD_SCRIPTS.items():
            compile(textwrap.dedent(script), f"<{name}>", "exec")
        return {"not_run": "no CUDA device: the child scripts were only compiled"}
    marker = secrets.token_hex(8)
    filled, total = _fill_and_kill(marker)
    control = {"filled_bytes": filled, **_scan(marker)}
    marker = secrets.token_hex(8)
    filled, total = _fill_and_kill(marker)
    wipe = _wipe()
    after = {"filled_bytes": filled, **_scan(marker)}
    covered = wipe["gpu_bytes_wiped"] / total
    return {"total_bytes": total, "negative_control": control, "wipe": wipe, "after_wipe": after,
            "covered_fraction_of_total": covered, "control_found_canary": control["canary_hits"] > 0,
            "ok": control["canary_hits"] > 0 and after["canary_hits"] == 0 and wipe["status"] == "ok"}


# ----------------------------------------------------------------- the run


def _part(results: dict[str, Any], name: str, deadline: float, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one part into ``results[name]``; a failure or the time budget is recorded, never hidden."""
    if time.monotonic() > deadline:
        results[name] = {"not_run": "time budget spent (--budget-s)"}
        return
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported in the JSON line; the other parts still run
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results[name]["seconds"] = round(time.monotonic() - t0, 1)
    print(f"== {name}: done in {results[name]['seconds']} s", flush=True)


def setup_job(workdir: Path, dry: bool, steps: int, threads: int) -> dict[str, Any]:
    """The shared job fields: tiny model (its tokenizer serves every shape), long-chat data, step tokens."""
    from trainer.catalog import make_tiny

    step_tokens, turns = (256, 2) if dry else (4096, 12)
    job: dict[str, Any] = {"workdir": str(workdir), "epochs": 1, "threads": threads, "step_tokens": step_tokens,
                           "shapes": DRY_SHAPES if dry else SHAPES, "standalone_dim": 256 if dry else 4096}
    job["tiny"] = str(make_tiny(workdir / "tiny"))
    job.update(bt.register(Path(job["tiny"]), "tiny", workdir))
    per_chat = 45 * turns  # tokens, about: one toy exchange is ~45 tokens
    n = math.ceil(steps * step_tokens / per_chat * 1.1)
    job.update(bt.write_data(workdir, long_chats(n, turns, seed=21), long_chats(16, turns, seed=22)))
    bt.add_counts(job, step_tokens)  # every shape shares make_tiny's tokenizer: one count of the data for all
    return job


NEEDS = {"bnb_4bit": ("torch", "transformers", "accelerate", "bitsandbytes", "pydantic", "safetensors"),
         "throughput": ("torch", "transformers", "accelerate", "bitsandbytes", "pydantic", "safetensors", "peft",
                        "trl", "datasets")}


def missing(part: str) -> dict[str, Any] | None:
    """``{"not_run": ...}`` naming the Python packages ``part`` needs that are not installed, else None."""
    import importlib.util

    absent = [m for m in NEEDS[part] if importlib.util.find_spec(m) is None]
    return {"not_run": f"python packages missing in {sys.executable}: {', '.join(absent)}"} if absent else None


def probe() -> tuple[bool, str]:
    """(CUDA available, device name), asked in a child so that this process never initialises CUDA."""
    code = "import torch; c = torch.cuda.is_available(); print(c, torch.cuda.get_device_name(0) if c else 'cpu')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: S603
                         timeout=120, check=False)
    first, _, name = out.stdout.strip().rpartition("\n")[2].partition(" ")
    return first == "True", name or "unknown (torch did not answer)"


def trainer_parts(results: dict[str, Any], args: argparse.Namespace, cuda: bool, deadline: float) -> None:
    """bnb_4bit and the two throughput parts, sharing one temp directory (tiny model, data)."""
    shapes = DRY_SHAPES if args.dry else SHAPES
    no_bnb, no_trl = missing("bnb_4bit"), missing("throughput")
    if no_bnb:  # the trainer itself cannot load: nothing to set up
        results.update({"bnb_4bit": no_bnb, **{f"throughput_{name}": no_bnb for name in shapes}})
        return
    run: Runner = in_process if args.dry else bt.in_fresh_process
    steps = args.steps or (5 if args.dry else 20)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        job = setup_job(Path(tmp), args.dry, steps, args.threads or (1 if args.dry else 8))
        job["cuda"] = cuda
        _part(results, "bnb_4bit", deadline, lambda: run(check_bnb, job))
        _part(results, "fsdp_qlora", deadline, lambda: fsdp_smoke(job, run))
        print(bt.describe_peer(cuda, job["step_tokens"], job), flush=True)
        for name in shapes:
            def part(name: str = name) -> dict[str, Any]:
                return no_trl or throughput(job, name, run, args.repeats, results["peak_bf16_flops"])

            _part(results, f"throughput_{name}", deadline, part)


def main() -> None:
    """Run the parts within the budget and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, in-process: checks the code paths")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per contender, about (0: 20, dry 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: 1 dry, else 8)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no part after this many seconds")
    args = parser.parse_args()
    bt.quiet()
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cuda, device = (False, "cpu") if args.dry else probe()
    flops, source = peak_flops(device)
    results: dict[str, Any] = {"bench": "gpu", "dry": args.dry, "cuda": cuda, "device": device,
                               "peak_bf16_flops": flops, "peak_flops_source": source}
    print(f"device {device}: {source}", flush=True)
    _part(results, "wipe", deadline, lambda: wipe_check(cuda))
    try:
        trainer_parts(results, args, cuda, deadline)
    except Exception as e:  # noqa: BLE001 - the setup (tiny model, data) failed: said in the JSON line
        results["trainer_setup"] = {"error": f"{type(e).__name__}: {e}"}
    results["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
