"""Packed micro-batches (`learner/packing.py`) against the padded batch they replace: the same log-probs and the
same gradients in fp32, for Llama and Qwen3 layers, shared prompts, a transcript's environment tokens, the head in
chunks and activation checkpointing. On CUDA the packed passes are flash varlen kernels (bf16 tolerance)."""

import pytest
import torch

from echo2cli.learner.trainer import Trainer

ROWS = [  # three prompts, two repeated (a GRPO group's samples); completions of 1-6 tokens; one transcript
    ([5, 6, 7, 8], [9, 10, 11], [-1.0] * 3),
    ([5, 6], [12, 13, 14, 15, 16], [-1.0] * 5),
    ([5, 6, 7, 8], [17], [-1.0]),
    ([3], [18, 19], [-1.0] * 2),
    ([5, 6], [20, 21, 22, 23, 24, 25], [-1.0] * 6, [1, 1, 0, 0, 1, 1]),  # tokens 2-3 the environment's
    ([5, 6, 7, 8], [22, 23, 24, 25], [-1.0] * 4),
]


def tiny(arch: str, path):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)  # fmt: skip
    if arch == "qwen3":
        Qwen3ForCausalLM(Qwen3Config(head_dim=8, **shape)).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(path)
    return path


def padded_logp(model: torch.nn.Module, rows: list, width: int) -> torch.Tensor:
    """The reference: every row right-padded in one batch with an attention mask, a plain forward, the
    log-prob of each completion token, completion-aligned [N, width]; 0 where the policy mask is 0."""
    length = max(len(r[0]) + len(r[1]) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c, *_) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        p, c = row[0], row[1]
        policy = torch.tensor(row[3] if len(row) > 3 else [1] * len(c), dtype=torch.float32)
        out[i, : len(c)] = logp[i, len(p) - 1 : len(p) + len(c) - 1] * policy
    return out


def trainer(path, **kw) -> Trainer:
    tr = Trainer(path, lr=1e-2, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=8, **kw)
    tr.autocast = False
    return tr


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "case", ["shared prompts", "a prompt per row", "the head in chunks", "activation checkpointing"]
)
def test_packed_log_probs_and_gradients_equal_the_padded_batchs_in_fp32(arch, case, tmp_path, monkeypatch):
    from echo2cli.learner import trainer as trainer_module

    if case == "the head in chunks":
        monkeypatch.setattr(trainer_module, "LOGIT_CHUNK", 4)
    path = tiny(arch, tmp_path)
    packed = trainer(path, share_prompts=case != "a prompt per row",
                     activation_checkpointing=case == "activation checkpointing")  # fmt: skip
    plain = trainer(path)
    if packed.device.type == "cuda":
        pytest.skip("fp32 equivalence is a CPU check; scripts/gpu_check.sh compares the varlen kernels on CUDA")
    pack = packed._pack(ROWS)
    got = packed._token_logp(packed.policy, pack)
    expected = padded_logp(plain.model, ROWS, pack.shape[1])
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))  # every token's gradient counts
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, a), b in zip(packed.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_pack_is_planned_from_the_rows_alone(tmp_path):
    """The layout: prompts first, each once, then completions; positions continue after each row's prompt; each
    completion's keys are its prompt's then its own; loss slots only where the policy mask is 1."""
    tr = trainer(tiny("llama", tmp_path))
    pack = tr._pack(ROWS)
    assert pack.prompt_pad.tolist() == [[0, 1, 2, 3], [4, 5, 5, 5], [6, 6, 6, 6]]  # right-padded, last repeated
    assert pack.prompt_keep.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert pack.span_pad[0].tolist() == [0, 1, 2, 3, 7, 8, 9, 9]  # row 0: prompt 0, then its completion
    assert pack.completion_pad[0].tolist() == [7, 8, 9, 9, 9, 9]
    assert pack.completion_keep[:4].tolist() == [0, 1, 2, 6]  # row 0's 3 outputs, then row 1's first
    mask = pack.span_mask[0, 0].int().tolist()  # row 0: 4 prompt tokens; completion token j sees keys 0 .. 4 + j
    assert mask[:3] == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]]
    assert mask[5] == [1] * 7 + [0]  # a padded query: never past the span, never empty
    assert pack.kv_index[:7].tolist() == [0, 1, 2, 3, 7, 8, 9]  # row 0: prompt 0, then its completion
    assert pack.loss_tokens == sum(len(r[1]) for r in ROWS) - 2
    assert pack.pick[:3].tolist() == [3, 7, 8]  # token 0 from the prompt's last position, then the completion's
    assert pack.cu_k.tolist()[:3] == [0, 7, 14] and pack.max_k == 2 + 6
    assert pack.cu_prompt.tolist() == [0, 4, 6, 7] and pack.max_prompt == 4  # the varlen kernel's offsets
    assert pack.cu_k.tolist() == [0, 7, 14, 19, 22, 30, 38]
    assert pack.span_completions[:5].tolist() == [4, 5, 6, 9, 10]  # row 0's completion, then row 1's


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None, align="bottom right"):
    """A varlen kernel written with SDPA, one sequence at a time (no GQA: the caller repeats kv heads). A causal
    mask over fewer queries than keys is aligned bottom-right (flash's: the last query sees every key) or
    top-left (the first query sees only the first key)."""
    import torch.nn.functional as F

    out = []
    for qa, qb, ka, kb in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:], strict=False):
        lq, lk = qb - qa, kb - ka
        shift = lk - lq if align == "bottom right" else 0
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + shift if is_causal else None
        qs, ks, vs = (x[a:b].transpose(0, 1) for x, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
    return torch.cat(out, dim=1).transpose(0, 1)


def test_the_varlen_guard_takes_the_fastest_mode_that_agrees_and_refuses_a_kernel_that_does_not(monkeypatch):
    """Pure logic, on CPU: the guard (`varlen_mode`) against stand-in kernels. Flash's bottom-right causal mask
    runs the completions' queries alone; a top-left one is right only with as many queries as keys (the whole
    span's); a kernel that ignores causality is refused, with a warning. On CUDA the real flash kernel meets the
    same guard (scripts/gpu_check.sh reports which mode ran)."""
    import warnings

    from echo2cli.learner import packing

    def top_left(*args, **kwargs):
        return reference_varlen(*args, **kwargs, align="top left")

    def forgetful(*args, is_causal=False, scale=None):
        return reference_varlen(*args, is_causal=False)

    cases = ((reference_varlen, packing.COMPLETION_QUERIES), (top_left, packing.SPAN_QUERIES), (forgetful, None))
    for kernel, expected in cases:
        monkeypatch.setattr(packing, "_VARLEN", [(kernel, {"is_causal", "scale"})])
        monkeypatch.setattr(packing, "_CHECKED", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert packing.varlen_mode(torch.device("cpu"), torch.bfloat16, 4, 2) == expected
        assert bool(caught) is (expected is None)  # a refusal says why


def test_compiled_layers_score_micro_batches_of_any_layout_with_one_graph(tmp_path, monkeypatch):
    """`compile_layers` (the trainer's --compile): micro-batches with other prompts, row counts and lengths run the
    one dynamic graph per layer code (dynamo's error_on_recompile would raise otherwise), and score as the eager
    layers do. The packed attention runs outside the graph. aot_eager: dynamo and autograd tracing without
    inductor's C++ build, which the GPU check runs."""
    import torch._dynamo

    from echo2cli.learner.trainer import compile_layers

    path = tiny("qwen3", tmp_path)
    eager, compiled = trainer(path), trainer(path)
    compile_layers(compiled.model, backend="aot_eager")
    torch._dynamo.reset()
    layouts = [ROWS, ROWS[1:4], [([7, 8, 9], [10] * 9, [-1.0] * 9)], ROWS[::2]]
    for i, rows in enumerate(layouts):
        if i == 1:  # the first layout compiled it: from here on, a recompilation is an error
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        pack = compiled._pack(rows)
        got = compiled._token_logp(compiled.policy, pack)
        want = eager._token_logp(eager.policy, eager._pack(rows))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.sum().backward()
    torch._dynamo.reset()
