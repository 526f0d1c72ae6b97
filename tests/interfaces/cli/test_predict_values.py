"""oomkit predict file.py:function with tensor value reads: logged ones stood in for, stated ones
used (--value), deciding ones refused naming the line."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("torch")

from oomkit.interfaces.cli import main  # noqa: E402

NANOGPT_LIKE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=1024, block=128, n_layer=2, n_head=4, n_embd=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        print(f"number of parameters: {sum(p.numel() for p in self.parameters())}")

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(batch_size, seq_len=128, log=True):
    model = GPT(block=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    x = torch.randint(0, 1024, (batch_size, seq_len))
    y = torch.randint(0, 1024, (batch_size, seq_len))

    def step():
        with ctx:
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if log:
            lossf = loss.item()  # LOGGED
            print(f"iter: loss {lossf:.4f}")

    return step, (model, optimizer, x, y)


def build_plain(batch_size, seq_len=128):
    return build(batch_size, seq_len, log=False)


def build_sized(batch_size):
    x = torch.randn(batch_size, 16)
    lin = nn.Linear(16, 16)

    def step():
        n = int(x.abs().sum().item())  # SIZES
        (lin(x).sum() + torch.zeros(n, 16).sum()).backward()

    return step, (lin, x)


def build_fixed(batch_size):
    x = torch.randn(batch_size, 16)
    lin = nn.Linear(16, 16)

    def step():
        (lin(x).sum() + torch.zeros(4096, 16).sum()).backward()

    return step, (lin, x)


def build_moves(batch_size):
    x = torch.randn(batch_size, 16)

    def step():
        x.to("cpu").numpy()  # MOVES

    return step, (x,)
'''


def _line(marker):
    return next(i for i, line in enumerate(NANOGPT_LIKE.splitlines(), 1) if marker in line)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nano.py").write_text(textwrap.dedent(NANOGPT_LIKE))
    return "nano.py"


def _predict(capsys, target, *extra):
    code = main(["predict", target, "--batch", "4", "--steps", "2", "--json", *extra])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code in (0, 1) else None), captured.err


def test_a_logged_loss_item_costs_nothing_and_is_listed(script, capsys):
    """nanoGPT's lossf = loss.item(): exit 0, the bytes of the step without it, one warning."""
    code, logged, err = _predict(capsys, f"{script}:build")
    assert code == 0
    _, plain, _ = _predict(capsys, f"{script}:build_plain")
    assert logged["peak_allocated_bytes"] == plain["peak_allocated_bytes"]
    assert logged["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    line = _line("# LOGGED")
    (warning,) = [w for w in logged["warnings"] if "Tensor.item() read" in w]
    assert warning.startswith(f"nano.py:{line} in step: Tensor.item() read a tensor value")
    assert "(2 time(s)); it got a stand-in (printed as nan" in warning
    assert "iter: loss nan" in err  # the user's print went to stderr, with the stand-in
    assert not any("torch.autocast('cuda') was entered" in w for w in logged["warnings"])


def test_a_read_that_sizes_a_tensor_exits_2_naming_the_line(script, capsys):
    """n = int(...item()) then torch.zeros(n): exit 2, the target and the line in one message."""
    code, _, err = _predict(capsys, f"{script}:build_sized")
    assert code == 2
    line = _line("# SIZES")
    assert f"oomkit: error: {script}:build_sized: nano.py:{line} in step: " in err
    assert "is used as an integer (a size, an index or a loop bound)" in err
    assert f"--value nano.py:{line}=NUMBER" in err


def test_a_stated_value_gives_the_bytes_of_the_step_written_with_it(script, capsys):
    """--value nano.py:LINE=4096 predicts what torch.zeros(4096, 16) written out predicts."""
    line = _line("# SIZES")
    code, stated, _ = _predict(capsys, f"{script}:build_sized", "--value", f"nano.py:{line}=4096")
    assert code == 0
    _, fixed, _ = _predict(capsys, f"{script}:build_fixed")
    assert stated["peak_allocated_bytes"] == fixed["peak_allocated_bytes"]
    assert stated["assumptions"][f"read at nano.py:{line} in step"] == (
        "Tensor.item() = 4096.0, as stated (--value / values=); 2 time(s)"
    )


def test_a_device_move_in_the_step_gets_device_advice(script, capsys):
    """x.to('cpu').numpy() in the step: exit 2, 'a device move', not the .item() advice."""
    code, _, err = _predict(capsys, f"{script}:build_moves")
    assert code == 2
    line = _line("# MOVES")
    assert f"{script}:build_moves: the step failed at nano.py:{line} in step: a device move" in err
    assert "Keep the step's tensors on the device" in err


def test_a_malformed_value_flag_is_a_usage_error(script, capsys):
    """--value without :LINE=NUMBER: exit 2 with the expected form."""
    with pytest.raises(SystemExit) as exited:
        main(["predict", f"{script}:build", "--value", "nano.py=3"])
    assert exited.value.code == 2
    assert "expected FILE:LINE=NUMBER" in capsys.readouterr().err


def test_a_line_stated_twice_with_two_values_is_refused(capsys):
    """--value t.py:3=1 --value t.py:3=2 had kept the last silently; the same value twice is
    one statement."""
    assert main(["predict", "gpt2-124m", "--value", "t.py:3=1", "--value", "t.py:3=2",
                 "--dump-config"]) == 2
    assert capsys.readouterr().err == (
        "oomkit: error: --value t.py:3 is given twice (1 and 2); state each line's value once\n"
    )
    assert main(["predict", "gpt2-124m", "--value", "t.py:3=1", "--value", "t.py:3=1",
                 "--dump-config"]) == 0
    assert '"t.py:3" = 1' in capsys.readouterr().out
