"""attn_implementation="flashop" in Hugging Face transformers (flashop/integrations/transformers.py): tiny
randomly initialised models built from configs (nothing downloaded), each run with transformers' own
eager attention as the reference: logits, a training step's gradients and greedy generate(), with padding
(left and right), packed sequences, sliding windows, softcap and gpt-oss's attention sinks."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import flashop.integrations.transformers  # noqa: E402  (registers "flashop")
from conftest import DEVICES  # noqa: E402

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def mistral():  # every layer a sliding window shorter than the sequences
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=5))


def qwen2():
    config = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    config.layer_types = ["full_attention", "sliding_attention"]
    return transformers.Qwen2ForCausalLM(config)


def gemma2():  # alternating sliding-window layers and a softcap low enough to bend random scores
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, head_dim=16, sliding_window=4, attn_logit_softcapping=1.5, final_logit_softcapping=None,
        query_pre_attn_scalar=16))


def gpt_oss():  # attention sinks (s_aux) and sliding-window layers
    # Every token routed to every expert: with top-2 of 4, a bf16 rounding difference in attention flips a
    # token's expert choice (a discontinuity) and fails about one bf16 seed in seven on the logits.
    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64}, head_dim=16, sliding_window=4,
                                       num_local_experts=4, num_experts_per_tok=4)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # sinks large enough to take a visible share of each row
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


MODELS = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma2": gemma2}
# Before 5.3, gpt-oss's config refuses every FlashAttention-named implementation but one hub kernel.
if hasattr(transformers, "GptOssForCausalLM") and tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 3):
    MODELS["gpt_oss"] = gpt_oss


def build(name, device):
    model = MODELS[name]().to(device)
    if device == "cuda":  # the CUDA kernels take 16-bit inputs
        model = model.to(torch.bfloat16)
    return model.eval()


def tolerance(device):
    return dict(atol=2e-4, rtol=2e-4) if device == "cpu" else dict(atol=4e-2, rtol=4e-2)


def reference(model):
    """transformers' own implementation to compare with: eager attention, the one every model has with all
    its score modifiers (some releases' SDPA path drops Gemma 2's softcap)."""
    return "eager"


def run(model, implementation, **inputs):
    model.set_attn_implementation(reference(model) if implementation == "reference" else implementation)
    return model(**inputs).logits


def batch(device, lengths, seqlen, left):
    """Token ids (len(lengths), seqlen) and a padding mask with lengths[b] real tokens, padded on the left or
    the right."""
    ids = torch.randint(1, VOCAB, (len(lengths), seqlen), device=device)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long, device=device)
    for b, n in enumerate(lengths):
        (mask[b, seqlen - n:] if left else mask[b, :n]).fill_(1)
    return ids, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_match_transformers(device, name, padding):
    model = build(name, device)
    ids, mask = batch(device, [11, 7, 3] if padding != "none" else [11, 11, 11], 11, padding == "left")
    inputs = dict(input_ids=ids, attention_mask=mask)
    ours, ref = run(model, "flashop", **inputs), run(model, "reference", **inputs)
    real = mask.bool()  # padded positions are not defined by either implementation
    torch.testing.assert_close(ours[real].float(), ref[real].float(), **tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "gemma2"] + (["gpt_oss"] if "gpt_oss" in MODELS else []))
def test_training_step_gradients_match_transformers(device, name):
    model = build(name, device).train()
    ids, mask = batch(device, [10, 6], 10, left=False)
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for implementation in ("flashop", reference(model)):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads["ours" if implementation == "flashop" else "reference"] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["ours"].keys() == grads["reference"].keys()
    for n, g in grads["reference"].items():
        scale = g.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(grads["ours"][n] / scale, g / scale, **tolerance(device), msg=n)


def assert_same_greedy_tokens(model, ours, ref, prompt_len, prompt_mask):
    """Greedy generations agree token for token, or first differ where the reference's two best logits tie
    to rounding (16-bit CUDA runs), after which they may go their own ways. The tie is judged on the logits
    generation saw: the prompt's padding mask, then every generated token."""
    if torch.equal(ours, ref):
        return
    for row in range(ours.size(0)):
        differ = (ours[row] != ref[row]).nonzero()
        if differ.numel() == 0:
            continue
        step = int(differ[0])
        assert step >= prompt_len
        model.set_attn_implementation(reference(model))
        mask = torch.ones_like(ref[row:row + 1, :step])
        mask[:, :prompt_len] = prompt_mask[row:row + 1]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() derives them from the mask
        logits = model(input_ids=ref[row:row + 1, :step], attention_mask=mask,
                       position_ids=positions).logits[0, -1].float()
        top = logits.topk(2).values
        assert top[0] - top[1] < 5e-2 * top[0].abs().clamp_min(1), f"row {row} differs at token {step}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_matches_transformers(device, name):
    model = build(name, device)
    ids, mask = batch(device, [9, 5, 2], 9, left=True)  # generation pads on the left
    outputs = []
    for implementation in ("flashop", reference(model)):
        model.set_attn_implementation(implementation)
        outputs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      pad_token_id=0))
    assert_same_greedy_tokens(model, *outputs, ids.size(1), mask)


def separate_runs(model, ids, lengths):
    """Each packed sequence on its own: the logits packing must reproduce."""
    model.set_attn_implementation(reference(model))
    pieces, start = [], 0
    for n in lengths:
        pieces.append(model(input_ids=ids[:, start:start + n]).logits)
        start += n
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_from_position_ids(device, name):
    model = build(name, device)
    lengths = [7, 3, 12]
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    ours = run(model, "flashop", input_ids=ids, position_ids=position_ids)
    torch.testing.assert_close(ours.float(), separate_runs(model, ids, lengths).float(), **tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_sequences_from_cu_seq_lens(device):
    model = build("llama", device)
    lengths = [5, 9, 1, 6]
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), device=device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    ours = run(model, "flashop", input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
               max_length_q=max(lengths), max_length_k=max(lengths))
    torch.testing.assert_close(ours.float(), separate_runs(model, ids, lengths).float(), **tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_has_no_graph_break(device):
    model = build("llama", device)
    ids = torch.randint(1, VOCAB, (2, 16), device=device)
    expected = run(model, "reference", input_ids=ids)
    model.set_attn_implementation("flashop")
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises under fullgraph
    torch.testing.assert_close(compiled(input_ids=ids).logits.float(), expected.float(), **tolerance(device))


def test_from_pretrained_selects_flashop(tmp_path):
    llama().save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="flashop")
    assert model.config._attn_implementation == "flashop"
    ids = torch.randint(1, VOCAB, (1, 6))
    expected = run(model, "reference", input_ids=ids)
    torch.testing.assert_close(run(model, "flashop", input_ids=ids), expected, atol=2e-4, rtol=2e-4)


def test_custom_4d_masks_are_refused_by_name():
    model = build("llama", "cpu")
    model.set_attn_implementation("flashop")
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="2-D padding mask"):
        flashop.integrations.transformers.attention_forward(attention, q, k, k, torch.ones(1, 1, 3, 3))
