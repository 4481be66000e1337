"""Self-speculative generation against plain KV-cache generation, on a run trained with
multi-token depths (``model.mtp_depth > 0``).

Greedy decoding of ``--prompts`` prompts (the starts of lines of the standard library's
top-level modules, 8 to 16 characters), each ``--new-tokens`` long, plainly and with the
depths drafting (``forge.model.speculative``), alternating which goes first; checks that
every output is the same, and prints the drafts kept, the main model's forwards per token
and the tokens/s of both with their ratio, by the wall clock and by the process's CPU time (one
thread: the steadier figure on a machine other jobs share)::

    python benchmarks/speculative.py runs/mtp [--prompts 50] [--new-tokens 100]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import torch

from forge.cli import DtypeRequest, summary
from forge.model.generate import sample
from forge.model.speculative import speculation_problem, speculative_sample
from forge.model.transformer import Transformer
from forge.optim.optimizers import evaluation_weights
from forge.training.evaluation.inference import load_for_inference, run_tokenizer
from forge.training.records.run_dir import load_run_config


def prompts_of(count: int) -> list[str]:
    """The first words of ``count`` lines of Python (the standard library's own files)."""
    root = pathlib.Path(__import__("json").__file__).parent.parent
    lines: list[str] = []
    for path in sorted(root.glob("*.py")):
        for line in path.read_text(errors="replace").splitlines():
            text = line.strip()
            if len(text) > 24 and not text.startswith("#"):
                lines.append(text[: 8 + len(lines) % 9])
            if len(lines) == count:
                return lines
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("run", type=pathlib.Path, help="a run trained with model.mtp_depth > 0")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_run_config(args.run)
    auto = DtypeRequest.AUTO
    loaded = load_for_inference(config, args.run, None, torch.device("cpu"), auto, print)
    model = loaded.model
    assert isinstance(model, Transformer)
    problem = speculation_problem(model)
    if problem is not None:
        print(f"error: {args.run}: {problem}", file=sys.stderr)
        return 2
    tok = run_tokenizer(config)
    prompts = [tok.encode(p.encode(), bos=True) for p in prompts_of(args.prompts)]
    plain_s = spec_s = plain_cpu = spec_cpu = 0.0
    load = os.getloadavg()[0]
    drafted = kept = forwards = tokens = 0
    with evaluation_weights(loaded.optimizer):
        sample(model, prompts[0], 8, temperature=0)  # warm-up
        for i, prompt in enumerate(prompts):
            new = min(args.new_tokens, config.model.max_seq_len - len(prompt))
            order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
            outs = {}
            for which in order:
                start, cpu = time.perf_counter(), time.process_time()
                if which == "plain":
                    outs[which] = sample(model, prompt, new, temperature=0)
                    plain_s += time.perf_counter() - start
                    plain_cpu += time.process_time() - cpu
                else:
                    outs[which], spec = speculative_sample(model, prompt, new, temperature=0)
                    spec_s += time.perf_counter() - start
                    spec_cpu += time.process_time() - cpu
                    drafted, kept = drafted + spec.drafted, kept + spec.accepted
                    forwards += spec.forwards
            if outs["plain"] != outs["spec"]:
                print(f"error: prompt {i}: speculative output differs from plain", file=sys.stderr)
                return 1
            tokens += len(outs["plain"]) - len(prompt)
    m = config.model
    print(
        f"cpu: {platform.processor() or platform.machine()}, 1 thread, torch {torch.__version__};"
        f" load average {load:.2f} at the start"
    )
    print(
        f"model: {m.dim}d x {m.n_layers} layers, mtp_depth {m.mtp_depth}, {len(prompts)} prompts,"
        f" {tokens} new tokens, greedy, {str(loaded.dtype).removeprefix('torch.')}"
    )
    print(f"identical outputs: {len(prompts)}/{len(prompts)}")
    print(f"drafts kept: {kept}/{drafted} ({kept / max(drafted, 1):.1%})")
    print(f"main-model forwards per token: {forwards / tokens:.3f} (plain: 1)")
    print(f"plain:       {tokens / plain_s:8.1f} tokens/s ({tokens / plain_cpu:8.1f} by CPU time)")
    print(f"speculative: {tokens / spec_s:8.1f} tokens/s ({tokens / spec_cpu:8.1f} by CPU time)")
    ratio, cpu_ratio = plain_s / spec_s, plain_cpu / spec_cpu
    print(f"ratio speculative / plain: {ratio:.2f} ({cpu_ratio:.2f} by CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
