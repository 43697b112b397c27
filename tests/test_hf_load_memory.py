"""The HF import streams (moe.hf.load_model): each tensor of the checkpoint is read once, when its layer is reached,
and dropped once copied into the model, so no more than one layer's tensors are ever alive at a time (the whole
checkpoint was, before); block-FP8 weights are dequantized as they are read, one tensor at a time. Counted, not
measured: benchmarks/hf_import_memory.py measures the resident memory."""

import collections
import re
import weakref

import numpy as np
import pytest

from benchmarks.hf_import_memory import to_block_fp8
from moe.hf import HFImportError, load_model
from moe.hf.quant import Fp8Blocks
from moe.hf.safetensors_io import flat_variables
from moe.hf.tensors import SafetensorsFiles
from moe.hf.write import write_hf_checkpoint
from tests.model_fixtures import tiny_model
from train.data.tokenizer import DEFAULT_TOKENIZER


@pytest.mark.parametrize("fp8", [False, True])
def test_the_import_holds_at_most_one_layers_tensors_at_a_time(tmp_path, monkeypatch, fp8):
    model = tiny_model(n_layers=4)
    write_hf_checkpoint(model, str(tmp_path), str(DEFAULT_TOKENIZER), max_shard_bytes=20_000)
    quant = None
    if fp8:  # every Linear weight F8_E4M3 + F32 scales (128 x 128 tiles: one partial tile each here), the rest BF16
        to_block_fp8(str(tmp_path))
        quant = Fp8Blocks(128, 128)
        with pytest.raises(HFImportError, match="is F8_E4M3 but config.json has no quantization_config"):
            SafetensorsFiles(str(tmp_path))  # FP8 tensors indeed
    shapes = SafetensorsFiles(str(tmp_path), quant).shapes
    group = lambda name: (re.match(r"model\.layers\.(\d+)\.", name) or [None, "rest"])[1]
    per_group = collections.Counter()
    for name, shape in shapes.items():
        per_group[group(name)] += 4 * int(np.prod(shape))
    assert len(per_group) == 5

    live, peak, reads = [0], [0], []
    read = SafetensorsFiles.read

    def counted(self, name):
        arr = read(self, name)
        reads.append(name)
        live[0] += arr.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(arr, lambda n: live.__setitem__(0, live[0] - n), arr.nbytes)
        return arr

    monkeypatch.setattr(SafetensorsFiles, "read", counted)
    loaded = load_model(str(tmp_path))
    assert sorted(reads) == sorted(shapes)  # every tensor read, once
    assert live[0] == 0
    assert 0 < peak[0] <= max(per_group.values()) < sum(per_group.values()) / 2, (peak[0], per_group)
    ours = flat_variables(model)
    for k, v in flat_variables(loaded).items():
        if fp8:  # within e4m3's rounding (3 mantissa bits: 1/16 of a value) of the model it was quantized from
            np.testing.assert_allclose(v, ours[k], rtol=0, atol=np.abs(ours[k]).max() / 16, err_msg=k)
        else:
            np.testing.assert_array_equal(v, ours[k], err_msg=k)
