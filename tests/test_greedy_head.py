"""The last stage's greedy head reduces the logits a vocabulary chunk at a time: the same tokens as the
argmax of the whole logits, the first index on ties (also across chunks), and the same logits when they are
needed whole."""

import torch

from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.models.vocab import HEAD_VOCAB_CHUNK
from ringsched.weights.model_config import ModelConfig


def _head_model(vocab: int) -> StageModel:
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
    })  # fmt: skip
    torch.manual_seed(0)
    return StageModel(cfg, StageInfo(0, 1, 0, 1))


@torch.inference_mode()
def test_greedy_tokens_equal_the_argmax_of_the_whole_logits():
    vocab = 2 * HEAD_VOCAB_CHUNK + 1000  # three chunks, the last one short
    model = _head_model(vocab)
    hidden = torch.randn(37, 32)
    whole = torch.nn.functional.linear(hidden, model.lm_head.weight)
    assert torch.equal(model.greedy_tokens(hidden), whole.argmax(dim=-1))
    torch.testing.assert_close(model.compute_logits(hidden), whole, rtol=1e-6, atol=1e-6)
    assert model.greedy_tokens(hidden[:0]).shape == (0,)


@torch.inference_mode()
def test_ties_go_to_the_first_index_across_chunks():
    vocab = 2 * HEAD_VOCAB_CHUNK + 1000
    model = _head_model(vocab)
    hidden = torch.randn(4, 32)
    w = model.lm_head.weight
    top = hidden[0] * 10  # row 0's logit for these words beats every random word
    later, last = HEAD_VOCAB_CHUNK + 5, 2 * HEAD_VOCAB_CHUNK + 7
    for word in (later, last, 100):  # the same word vector three times, in three chunks
        w[word] = top
    assert model.greedy_tokens(hidden)[0].item() == 100
    assert model.compute_logits(hidden).argmax(dim=-1)[0].item() == 100
    w[100] = -top  # now the tie is between chunks 2 and 3: the earlier chunk's word wins
    assert model.greedy_tokens(hidden)[0].item() == later


def test_only_plain_greedy_batches_take_the_chunked_head():
    from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry
    from ringsched.sampling.params import SamplingParams
    from ringsched.stage.sampler_state import SamplerState

    kinds = {
        "greedy": SamplingParams(temperature=0.0),
        "random": SamplingParams(temperature=0.8, seed=1),
        "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.2),
        "min_tokens": SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4),
    }
    state = SamplerState(torch.device("cpu"), eos_ids=(2,))
    announce = [NewRequest(rid, [], p.to_dict(), prompt_len=1) for rid, p in kinds.items()]
    entries = [PlanEntry(r, 0, [5], samples=True) for r in kinds]
    state.apply(BatchPlan(slot=0, seq=0, entries=entries, announce=announce))

    def plan(*rids: str, samples: bool = True) -> BatchPlan:
        return BatchPlan(slot=0, seq=1, entries=[PlanEntry(r, 1, [6], samples=samples) for r in rids])

    assert state.greedy_only(plan("greedy"))
    assert state.greedy_only(plan("random", samples=False))  # rows that do not sample do not count
    for other in ("random", "penalised", "min_tokens"):
        assert not state.greedy_only(plan("greedy", other))
