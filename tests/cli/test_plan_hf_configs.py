"""`pipetorch plan config.json`: each HuggingFace family the library splits, the class named."""
import json

import pytest

from pipetorch.cli.main import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

TINY = dict(vocab_size=64, d_model=32, d_ff=64)


def plan_json(tmp_path, capsys, config, *flags):
    config.to_json_file(str(tmp_path / "config.json"))
    code = main(["plan", str(tmp_path / "config.json"), "--devices-per-machine", "2",
                 "--sequence", "16", "--flops", "1T", "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def bert(**kwargs):
    return transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=32, **kwargs)


def t5(**kwargs):
    return transformers.T5Config(d_kv=16, num_layers=2, num_heads=2, **TINY, **kwargs)


# issue 53: BERT was planned as BertLMHeadModel whatever its architectures said, and T5 ended
# in "You must specify exactly one of input_ids or inputs_embeds" (no decoder inputs)
@pytest.mark.parametrize("config, model, cut", [
    (bert(), "BertForMaskedLM", "bert.encoder.layer.1"),
    (bert(architectures=["BertForSequenceClassification"]), "BertForSequenceClassification",
     "bert.encoder.layer.1"),
    (t5(), "T5ForConditionalGeneration", "decoder.block.1"),
    (t5(architectures=["T5ForConditionalGeneration"]), "T5ForConditionalGeneration",
     "decoder.block.1"),
    (transformers.BartConfig(encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             max_position_embeddings=32, **TINY),
     "BartForConditionalGeneration", "model.decoder.layers.1"),
    (transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64),
     "ViTForImageClassification", "vit.layers.1"),
], ids=["bert", "bert-named", "t5", "t5-named", "bart", "vit"])
def test_each_family_plans_from_its_config_and_names_the_class(tmp_path, capsys, config, model,
                                                               cut):
    code, found = plan_json(tmp_path, capsys, config, "--split", cut)
    assert code == 0 and found["model"] == model and found["cut"] == [cut]
    assert all(d["activations"] > 0 for d in found["devices"])


def test_the_text_names_the_class(tmp_path, capsys):
    bert().to_json_file(str(tmp_path / "config.json"))
    assert main(["plan", str(tmp_path / "config.json"), "--sequence", "16"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "model BertForMaskedLM"


def test_t5_has_no_position_table_to_outrun(tmp_path, capsys):
    code, found = plan_json(tmp_path, capsys, t5(), "--sequence", "4096")  # relative positions
    assert code == 0 and found["model"] == "T5ForConditionalGeneration"


def test_a_sequence_longer_than_the_positions_is_refused(tmp_path, capsys):
    # issue 53: --sequence 4096 on a GPT-2 of n_positions 1024 was planned (the meta device
    # has no bounds to check the position table's lookup against)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2)
    with pytest.raises(SystemExit) as exited:
        plan_json(tmp_path, capsys, config, "--sequence", "64")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2
    assert last.endswith("--sequence 64 is longer than GPT2LMHeadModel's position table "
                         "(n_positions 32 in its config); give --sequence 32 or less")
    # without --sequence: 1024, or the config's positions if fewer
    assert main(["plan", str(tmp_path / "config.json")]) == 0


def test_an_architecture_transformers_lacks_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        plan_json(tmp_path, capsys, bert(architectures=["NoSuchModel"]))
    assert exited.value.code == 2
    assert "architectures ['NoSuchModel'] names no class" in capsys.readouterr().err
