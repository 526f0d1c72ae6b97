"""A training script as people write it: argparse, a DataLoader, `device = "cuda" if ...`, a loop.

Predict it without a GPU, with the script's own arguments after `--`:

    oomkit predict examples/train_loop.py --gpu rtx4090 -- --batch_size 64

oomkit runs it as `python examples/train_loop.py --batch_size 64` would, with CUDA emulated,
records its first optimizer steps (`--steps`, default 3) and stops it there: the rest of the
loop and the checkpoint it saves at the end never run.
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(1024, 256), torch.randint(0, 10, (1024,)))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, pin_memory=True)
model = torch.nn.Sequential(
    torch.nn.Linear(256, args.hidden), torch.nn.GELU(),
    torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
    torch.nn.Linear(args.hidden, 10),
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for epoch in range(args.epochs):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"epoch {epoch}: loss {loss.item():.3f}")
torch.save(model.state_dict(), "checkpoint.pt")
