"""A trained model outside the Trainer (mhc_lightning/fit/pretrained.py, GPT.generate): LitLM.load_from_checkpoint,
generation from a prompt, `mhc export` to safetensors + config.json and load_pretrained, with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_fit

from mhc_lightning import LitLM, load_pretrained
from mhc_lightning.commands import main


def test_a_checkpoint_loads_generates_and_exports_with_the_same_logits(tiny_corpus, tmp_path, capsys):
    trainer, trained = tiny_fit(tiny_corpus, [], steps=3)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained.eval()(x)

    lit = LitLM.load_from_checkpoint(ckpt, map_location="cpu").eval()  # no Trainer anywhere
    with torch.no_grad():
        assert torch.equal(lit(x), expected)
    greedy = lit.model.generate("The ", 8, temperature=0)
    assert isinstance(greedy, bytes) and len(greedy) == 12 and greedy.startswith(b"The ")
    assert lit.model.generate(b"The ", 8, temperature=0) == greedy  # greedy is deterministic
    sampled = lit.model.generate(x[:, :4], 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    assert sampled.shape == (2, 9) and torch.equal(sampled[:, :4], x[:, :4]) and lit.model.training is False
    with pytest.raises(ValueError, match="temperature >= 0"):
        lit.model.generate(x, 1, temperature=-1)

    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as done:
        main(["export", str(ckpt), str(out)])
    assert done.value.code == 0 and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["arch"]["hyper"]["residual_mode"] == "mhc" and config["source"]["global_step"] == 3
    model = load_pretrained(out)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert model.generate("The ", 8, temperature=0) == greedy

    capsys.readouterr()
    with pytest.raises(SystemExit) as again:  # nothing replaced without --force
        main(["export", str(ckpt), str(out)])
    err = capsys.readouterr().err
    assert again.value.code == 2 and err.startswith("mhc export: error: ") and "already holds" in err
