"""The compiled path picks SDPA's kernel with the target's cuDNN version, as the eager path does.

On an H100, cuDNN attention is preferred from cuDNN 9.15.1 on (sdp_utils.cpp
check_prefer_cudnn_attention); below it, flash attention runs. The compiled path used to read the
cuDNN of the settings in effect (this torch build's, 9.20) whatever the target said.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomkit.core.target import Target  # noqa: E402
from oomkit.prediction.predictor import predict  # noqa: E402


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 32).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize(
    ("cudnn", "kernel", "said"),
    [(91002, "SDPA flash_attention", "9.10.2 (as given)"),
     (91501, "SDPA cudnn_attention", "9.15.1 (as given)")],
)
def test_the_target_cudnn_picks_the_kernel_eager_and_compiled(compile, cudnn, kernel, said):
    """cuDNN 9.10.2 runs flash attention on an H100, 9.15.1 cuDNN attention, compiled or not."""
    with torch.device("meta"):
        model = _Attention().to(torch.bfloat16)
        x = torch.randn(2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    run = torch.compile(model) if compile else model

    def step(x):
        run(x).backward()

    prediction = predict(
        step, x, track=(model,), target=Target.resolve("h100", cudnn_version=cudnn),
        compile=compile, steps=1,
    )
    assert dict(prediction.kernel_choices) == {kernel: 2 if compile else 1}
    assert prediction.assumptions["cuDNN"] == said
