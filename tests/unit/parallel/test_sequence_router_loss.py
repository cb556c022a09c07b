"""sp/cp and a MoE model's router auxiliary loss: a model whose modeling module has transformers'
`load_balancing_loss_func` gets the whole sequence's term on every rank (the router logits and the mask gathered over
the sequence group; tests/multiproc/parallelism/test_expert.py compares it with one process); one whose module has none is
refused in one line, as each rank would compute it on its slice only (counted sp_size times)."""

import types

import pytest
import torch

from accel.config import ConfigError
from accel.parallel.sequence import SequenceParallel
from accel.parallel.sequence_router_loss import computes_router_loss, excess


@pytest.mark.parametrize("kind", ["sp", "cp"])
def test_router_auxiliary_loss_without_the_function_is_refused_in_one_line(kind):
    transformers = pytest.importorskip("transformers")
    model = torch.nn.Linear(2, 2)  # its module has no load_balancing_loss_func
    sequence = types.SimpleNamespace(kind=kind)
    config = transformers.MixtralConfig(num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.1)
    with pytest.raises(ConfigError, match=rf"^{'sequence' if kind == 'sp' else 'context'} parallelism: Linear adds "
                                          r"its router's auxiliary loss \(MixtralConfig.output_router_logits=True, "
                                          rf"router_aux_loss_coef=0.1\).*no load_balancing_loss_func.*allowed: .* or "
                                          rf"{kind}_size 1$"):
        SequenceParallel._refuse_router_loss(sequence, model, config)
    plain = transformers.MixtralConfig(num_hidden_layers=1)  # output_router_logits False: the plain MoE
    SequenceParallel._refuse_router_loss(sequence, model, plain)
    with pytest.raises(ConfigError, match=r"forward.s output_router_logits=True"):  # model(..., the flag)
        SequenceParallel._refuse_router_loss(sequence, model, plain, in_forward=True)
    SequenceParallel._refuse_router_loss(sequence, model, transformers.MixtralConfig(
        num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.0))  # no loss added: nothing to refuse


def test_a_transformers_moe_model_computes_it_over_the_whole_sequence():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=16,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        vocab_size=32, output_router_logits=True, router_aux_loss_coef=0.1)
    model = transformers.MixtralForCausalLM(config)
    assert computes_router_loss(model)
    SequenceParallel._refuse_router_loss(types.SimpleNamespace(kind="sp"), model, config)  # not refused
    aux = torch.tensor(2.0)
    torch.testing.assert_close(excess(model, {"aux_loss": aux}, 4), torch.tensor(0.1 * 2.0 * 0.75))
    assert excess(model, {"aux_loss": None}, 4) is None
