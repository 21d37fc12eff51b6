"""Random-weight Hugging Face folders of many families, made the way a user's folder is made.

Each folder is transformers' own model saved with ``save_pretrained`` (seeded; weights scaled up
from the tiny init so outputs are far from constant and comparisons mean something) plus a
tokenizer trained in-process with the ``tokenizers`` library on attnx's built-in sentences
(WordPiece, byte-level BPE or Unigram, as the family uses), and for encoders a sentence-transformers
pooling module. Nothing is downloaded.

    folder = make_folder("llama", tmp_path)          # a LlamaForCausalLM folder with a BPE tokenizer
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
POSITIONS = 64


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class saved
    tokenizer: str  # wordpiece | bpe | unigram
    options: dict = field(default_factory=dict)
    pooling: str | None = None  # sentence-transformers pooling mode (encoders)
    variant: str = "smal"  # the placed variant the matrix tests besides mha
    pad_offset: int = 0  # RoBERTa-style position tables reserve padding_idx + 1 rows


def _decoder(**kw):
    return dict(SIZE, max_position_embeddings=POSITIONS, **kw)


#: The support matrix (issue 22): every family with its shape and the variant placed in it.
FAMILIES = {f.name: f for f in [
    Family("bert", "BertConfig", "BertModel", "wordpiece", dict(SIZE, max_position_embeddings=POSITIONS),
           pooling="mean", variant="smal"),
    Family("roberta", "RobertaConfig", "RobertaModel", "bpe",
           dict(SIZE, max_position_embeddings=POSITIONS + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2),
           pooling="cls", variant="cultural", pad_offset=2),
    Family("xlm-roberta", "XLMRobertaConfig", "XLMRobertaModel", "unigram",
           dict(SIZE, max_position_embeddings=POSITIONS + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2),
           pooling="mean", variant="metaphor", pad_offset=2),
    Family("distilbert", "DistilBertConfig", "DistilBertModel", "wordpiece",
           dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=POSITIONS),
           pooling="mean", variant="toy"),
    Family("electra", "ElectraConfig", "ElectraModel", "wordpiece",
           dict(SIZE, embedding_size=16, max_position_embeddings=POSITIONS), pooling="cls", variant="maw"),
    Family("modernbert", "ModernBertConfig", "ModernBertModel", "bpe",
           dict(SIZE, num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=8,
                max_position_embeddings=POSITIONS, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                cls_token_id=0, sep_token_id=2), pooling="mean", variant="smal"),
    Family("llama", "LlamaConfig", "LlamaForCausalLM", "bpe", _decoder(num_key_value_heads=2), variant="smal"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "bpe", _decoder(num_key_value_heads=2), variant="cultural"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "bpe", _decoder(num_key_value_heads=2, head_dim=16),
           variant="metaphor"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", "bpe", _decoder(num_key_value_heads=2, sliding_window=8),
           variant="maw"),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "bpe",
           _decoder(num_key_value_heads=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]), variant="toy"),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", "bpe", _decoder(num_key_value_heads=2), variant="smal"),
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel", "bpe",
           dict(n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS), variant="cultural"),
    # classifiers (cross-encoder and sentiment shapes)
    Family("bert-classifier", "BertConfig", "BertForSequenceClassification", "wordpiece",
           dict(SIZE, max_position_embeddings=POSITIONS, num_labels=3,
                id2label={0: "negative", 1: "neutral", 2: "positive"},
                label2id={"negative": 0, "neutral": 1, "positive": 2}), variant="smal"),
    # an ms-marco cross-encoder's shape: one relevance logit (served by /rerank, /v1/rerank)
    Family("bert-cross-encoder", "BertConfig", "BertForSequenceClassification", "wordpiece",
           dict(SIZE, max_position_embeddings=POSITIONS, num_labels=1), variant="cultural"),
    Family("qwen2-classifier", "Qwen2Config", "Qwen2ForSequenceClassification", "bpe",
           _decoder(num_key_value_heads=2, num_labels=1), variant="cultural"),
]}

SPECIALS = {"wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            "bpe": ["<s>", "<pad>", "</s>", "<unk>"],
            "unigram": ["<s>", "<pad>", "</s>", "<unk>"]}


def corpus() -> list[str]:
    from attnx.pretrained.sentences import SENTENCES

    return [s for s in SENTENCES] + [s.lower() for s in SENTENCES]


def train_tokenizer(kind: str, vocab: int = 200):
    """A ``tokenizers.Tokenizer`` trained on the built-in sentences (specials first, so ids 0.. are fixed)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = SPECIALS[kind]
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials)
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab + 256, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(corpus(), trainer)
    return tok


def make_folder(name: str, root: Path, seed: int = 0) -> Path:
    """``root/name``: the family's model (random, seeded), tokenizer and, for encoders, pooling."""
    import torch
    import transformers

    fam = FAMILIES[name]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(fam.tokenizer)
    specials = SPECIALS[fam.tokenizer]
    ids = {t: tok.token_to_id(t) for t in specials}
    cfg_kwargs = dict(fam.options)
    cfg_kwargs["vocab_size"] = tok.get_vocab_size()
    encoder = fam.pooling is not None or fam.model.startswith("Bert")
    if fam.tokenizer == "wordpiece":
        pad, bos, eos = ids["[PAD]"], ids["[CLS]"], ids["[SEP]"]
    else:
        pad, bos, eos = ids["<pad>"], ids["<s>"], ids["</s>"]
    cfg_kwargs.setdefault("pad_token_id", pad)
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos)):
        cfg_kwargs.setdefault(key, value)
    config = getattr(transformers, fam.config)(**cfg_kwargs)
    config.architectures = [fam.model]
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model)(config).eval()
    with torch.no_grad():  # a tiny init gives near-constant outputs: widen the weights
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
            elif "norm" in pname.lower() and pname.endswith("weight"):
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)

    _post_processor(tok, fam, ids, encoder)
    tok.save(str(folder / "tokenizer.json"))
    max_len = POSITIONS
    tok_cfg = {"model_max_length": max_len, "tokenizer_class": "PreTrainedTokenizerFast",
               "padding_side": "right" if encoder else "left"}
    if fam.tokenizer == "wordpiece":
        tok_cfg.update(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]",
                       mask_token="[MASK]")
    else:
        tok_cfg.update(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if fam.pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, f"pooling_mode_{ {'cls': 'cls_token', 'mean': 'mean_tokens'}[fam.pooling]}": True}))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len,
                                                                       "do_lower_case": False}))
    return folder


def _post_processor(tok, fam: Family, ids: dict, encoder: bool) -> None:
    """The family's special tokens around a text: [CLS] .. [SEP], <s> .. </s>, or a decoder's <s> prefix."""
    from tokenizers import processors

    if fam.tokenizer == "wordpiece":
        cls, sep = ids["[CLS]"], ids["[SEP]"]
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    elif encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])])


def lazy_folders(root: Path | None = None):
    """``get(name) -> Path``: the family's folder, made on first use: from the shared cache of
    ``tests/support`` (don't change it), or under ``root`` when given."""
    from support.exports import hf_folder

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_folder(name, root) if root is not None else hf_folder(name)
        return made[name]

    return get


def move_off_neutral(model, seed: int) -> None:
    """Variant parameters drawn at random (a neutral variant would only test plain attention)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in model.variant_parameter_names():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def placed_feeds(model, batch: int, seq: int) -> dict:
    """Token ids, a padded mask (lengths seq, 3seq/4, seq/2, 3) and random context inputs for a placed model."""
    import torch

    g = torch.Generator().manual_seed(1)
    feeds = {}
    for spec in model.input_specs():
        shape = [batch if d == "batch" else seq if d == "seq" else int(d) for d in spec.shape]
        if spec.role == "attention_mask":
            lengths = torch.tensor([seq, seq * 3 // 4, seq // 2, 3][:batch])
            feeds[spec.name] = (torch.arange(seq)[None] < lengths[:, None]).long()
        elif spec.dtype == "float":
            feeds[spec.name] = torch.randn(*shape, generator=g)
        else:
            low, high = spec.range or (0, 16)
            high = min(high, model.vocab_size) if spec.role == "input_ids" else high
            feeds[spec.name] = torch.randint(max(low, 3), high, shape, generator=g)
    return feeds
