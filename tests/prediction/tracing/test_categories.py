"""The category inference rule."""

from __future__ import annotations

from typing import get_args

from oomkit.prediction.tracing import CATEGORIES, infer_category
from oomkit.prediction.tracing.categories import PHASES, Role


def test_every_category_is_inferred_from_a_role_or_set_by_an_emulation():
    """The vocabulary has no dead entry: each category comes from an observed role (or is the
    activation/temporary fallback), but the two only ever set explicitly (cuBLAS/cuDNN/SDPA
    workspaces by op emulations, autocast's cached weight casts by the recorder)."""
    from_roles = {
        infer_category({role}, phase) for role in get_args(Role) for phase in PHASES
    } | {infer_category(set(), phase) for phase in PHASES}
    assert from_roles | {"workspace", "autocast_cache"} == set(CATEGORIES)
    assert not from_roles & {"workspace", "autocast_cache"}
    assert len(CATEGORIES) == 12


def test_allgather_buffer_wins_over_parameter():
    """An unsharded FSDP2 parameter (a view of its all-gather buffer) is that buffer."""
    assert infer_category({"parameter", "allgather_buffer"}, "forward") == "allgather_buffer"


def test_gradient_wins_over_reduce_scatter_buffer():
    """A reduce-scatter output that becomes the sharded gradient is a gradient."""
    assert infer_category({"reduce_scatter_buffer", "gradient"}, "backward") == "gradient"


def test_gradient_wins_over_ddp_bucket():
    """A DDP bucket whose views are the gradients (gradient_as_bucket_view) is the gradients."""
    assert infer_category({"ddp_bucket", "gradient"}, "user") == "gradient"
    assert infer_category({"ddp_bucket"}, "forward") == "ddp_bucket"


def test_parameter_wins_over_saved():
    """A parameter that autograd saves (Linear weight) is still a parameter."""
    assert infer_category({"saved", "parameter"}, "user") == "parameter"


def test_input_wins_over_saved():
    """The batch saved by the first Linear is an input."""
    assert infer_category({"saved", "input"}, "user") == "input"


def test_saved_is_activation_in_any_phase():
    """Whatever autograd saves is an activation."""
    assert infer_category({"saved"}, "user") == "activation"


def test_escaped_forward_allocation_is_activation():
    """A forward allocation alive after the root module returned is an activation."""
    assert infer_category({"escaped"}, "forward") == "activation"
    assert infer_category(set(), "forward") == "temporary"


def test_backward_and_optimizer_scratch_is_temporary():
    """Allocations that get no role are temporaries."""
    assert infer_category(set(), "backward") == "temporary"
    assert infer_category(set(), "optimizer") == "temporary"


def test_explicit_category_wins():
    """An emulation's category (workspace) overrides observed roles."""
    assert infer_category({"input"}, "forward", "workspace") == "workspace"
