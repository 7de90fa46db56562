"""Gate optimiser (calibration.gates) on a tiny model whose weights plant one head that
copies from far back: that head must rank first, the distillation loss must fall, and
training is deterministic for a seed."""
import pytest
import torch

from headwise.calibration.calibrate import gate_dtype
from headwise.calibration.gates import GateSample, train_gates, window_mask
from headwise.models.causal_lm import CausalLM
from headwise.models.config import ModelConfig

MARKER, SINK, WINDOW, T = 5, 4, 32, 160
PLANTED = (1, 1)  # (layer, KV head)


def planted_model() -> CausalLM:
    """2 layers, 4 query / 2 KV heads of 16 dims. Every weight is small except KV head 1 of
    layer 1 (query heads 2, 3): its query is a constant (the q bias) and its key is large
    only for the marker token, both in the slowest rotary pair (dims 7 and 15), so it
    attends to the marker wherever it is and writes the marker's value into the residual."""
    cfg = ModelConfig("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=512,
                      attention_bias=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name and "embed" not in name:
                p.mul_(0.05)
        e = m.model.embed_tokens.weight[MARKER] / m.model.embed_tokens.weight[MARKER].norm()
        att = m.model.layers[1].self_attn
        kv = slice(16, 32)  # KV head 1's rows of k_proj / v_proj
        att.k_proj.weight[kv] = 0
        att.k_proj.bias[kv] = 0
        att.k_proj.weight[16 + 7] = 8.0 * e * 32 ** 0.5  # k[7] ~ 8 sqrt(32) (e . x / |x|)
        att.q_proj.weight[32:64] = 0                     # query heads 2, 3
        att.q_proj.bias[32:64] = 0
        att.q_proj.bias[32 + 7] = att.q_proj.bias[48 + 7] = 4.0
        att.v_proj.weight[kv] = torch.randn(16, 32)
        att.o_proj.weight[:, 32:64] = torch.randn(32, 32)
    return m


def samples(n: int = 4) -> list[GateSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(6, 64, (T,), generator=g)
        ids[10 + 7 * i] = MARKER  # far outside sink + window from the answer rows
        out.append(GateSample(ids.tolist(), list(range(T - 8, T))))
    return out


def test_window_mask_keeps_sink_and_recent_tokens():
    m = window_mask(10, 2, 3)
    assert m[9].tolist() == [True, True] + [False] * 5 + [True] * 3
    assert m[3].tolist() == [True] * 4 + [False] * 6  # causal
    assert not m.triu(1).any()


def test_planted_head_matters_most_when_windowed():
    # The premise of the next test, checked directly: windowing the planted head changes the
    # answer rows' hidden states far more than windowing any other head.
    m = planted_model()
    s = samples(1)
    change = {}
    for l in range(2):
        for h in range(2):
            only = torch.zeros(2, 2, dtype=torch.bool)
            only[l, h] = True
            r = train_gates(m, s, only, {}, SINK, WINDOW, steps=1, lr=0.0, l1=0.0, init=0.0)
            change[(l, h)] = r.losses[0]
    assert max(change, key=change.get) == PLANTED
    assert change[PLANTED] > 10 * max(v for k, v in change.items() if k != PLANTED)


def test_gates_rank_the_planted_head_first_and_the_loss_falls():
    m = planted_model()
    cand = torch.ones(2, 2, dtype=torch.bool)
    r = train_gates(m, samples(), cand, {}, SINK, WINDOW, steps=40, lr=0.05, l1=0.05, seed=0)
    flat = r.scores.flatten().argsort(descending=True).tolist()
    assert divmod(flat[0], 2) == PLANTED
    assert r.gates[PLANTED] > 0.9
    assert sum(r.losses[-5:]) / 5 < 0.5 * sum(r.losses[:5]) / 5
    # the model's own attention is back in place
    assert all(type(l.self_attn.attn).__name__ == "HeadSplitAttention" for l in m.model.layers)


def test_gates_train_over_bfloat16_weights():
    # `headwise calibrate --dtype bfloat16`: the same planted head ranks first and the loss,
    # taken in float32, falls; the gates stay float32.
    m = planted_model().to(torch.bfloat16)
    cand = torch.ones(2, 2, dtype=torch.bool)
    r = train_gates(m, samples(), cand, {}, SINK, WINDOW, steps=40, lr=0.05, l1=0.05, seed=0)
    assert r.gates.dtype == torch.float32
    assert divmod(int(r.ranking.flatten().argmax()), 2) == PLANTED
    assert sum(r.losses[-5:]) / 5 < 0.5 * sum(r.losses[:5]) / 5


def test_gate_dtype_is_float32_unless_bfloat16_is_asked():
    assert gate_dtype("auto") == gate_dtype("float32") == torch.float32
    assert gate_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gate_dtype("float16")


def test_gate_training_is_deterministic_for_a_seed():
    m = planted_model()
    cand = torch.tensor([[True, False], [True, True]])
    a = train_gates(m, samples(3), cand, {}, SINK, WINDOW, steps=6, seed=4)
    b = train_gates(m, samples(3), cand, {}, SINK, WINDOW, steps=6, seed=4)
    assert torch.equal(a.scores, b.scores) and a.losses == b.losses
    assert a.scores[0, 1] == 0 and a.gates[0, 1] == 0  # not a candidate: no score


def test_gate_training_rejects_bad_arguments():
    m = planted_model()
    cand = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one sample"):
        train_gates(m, [], cand, {}, SINK, WINDOW, steps=2)
    with pytest.raises(ValueError, match="steps"):
        train_gates(m, samples(1), cand, {}, SINK, WINDOW, steps=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gated_model_is_the_engines_full_and_window_function(tiny_models, arch):
    # Gates all 1: the engine's `full` layout; all 0: its all-window layout (float32).
    from headwise import LLM
    from headwise.heads.layout import HeadLayout
    from headwise.calibration.gates import gated, hidden_states
    from headwise.weights.loader import load_model

    path = str(tiny_models[arch])
    m, _ = load_model(path, torch.float32)
    ids = torch.arange(10, 130)
    rows = torch.arange(120)
    cand = torch.ones(2, 2, dtype=torch.bool)
    for value, layout in ((1.0, "full"), (0.0, HeadLayout.window((2, 2, m.config.head_dim), sink=4, window=16))):
        llm = LLM(path, head_layout=layout, dtype="float32", kv_cache_memory=1 << 24)
        want = llm.engine.prompt_logits(ids.tolist())
        with torch.no_grad(), gated(m, torch.full((2, 2), value), cand, {}, 4, 16):
            got = m.lm_head(hidden_states(m, ids, rows, False))
        assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (value, (got - want).abs().max())


def test_closed_gates_rank_by_their_pull_toward_opening():
    # An L1 pull far stronger than any head's use closes every gate; the ranking still puts
    # the planted head first, by the distillation gradient that resists the pull.
    m = planted_model()
    cand = torch.ones(2, 2, dtype=torch.bool)
    r = train_gates(m, samples(), cand, {}, SINK, WINDOW, steps=12, lr=0.2, l1=50.0, seed=0)
    assert (r.scores == 0).all() and (r.gates == 0).all()
    rank = r.ranking
    assert (rank <= 0).all() and (rank >= -1).all()
    flat = rank.flatten().argsort(descending=True).tolist()
    assert divmod(flat[0], 2) == PLANTED and rank[PLANTED] == 0
    assert r.pressure[PLANTED] > 10 * max(float(r.pressure[l, h]) for l in range(2) for h in range(2)
                                          if (l, h) != PLANTED)


def test_open_gates_rank_above_closed_ones():
    m = planted_model()
    cand = torch.ones(2, 2, dtype=torch.bool)
    r = train_gates(m, samples(), cand, {}, SINK, WINDOW, steps=40, lr=0.05, l1=0.05, seed=0)
    rank = r.ranking
    open_ = r.scores > 0
    assert torch.equal(rank[open_], r.scores[open_])
    assert open_.any() and (~open_).any()  # with these settings some gates close, the planted one not
    assert rank[~open_].max() < rank[open_].min()
