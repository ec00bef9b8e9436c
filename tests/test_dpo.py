"""DPO: the dpo_norm loss against a numpy transcription of open-instruct's formula, per-sequence
log-probs and gradients against transformers' Olmo3ForCausalLM, the pair data set under the
loader's exactly-once order, and the reference cache's fingerprint."""
import json
import os
import re

import numpy as np
import pytest

import equinox as eqx
import jax
import jax.numpy as jnp

import data
from data import preference
from data.preference import PairDataset, write_pairs
from olmo3 import dpo, reference
from olmo3.cli import UserError
from oracles import log_softmax64

BETA = 5.0


# --------------------------------------------------------------------------------------------
# The numpy oracle, written from open-instruct's dpo_utils.dpo_loss / _get_batch_logps(average_log_prob=True)
# --------------------------------------------------------------------------------------------
def oracle_dpo_norm(pol_sum, ref_sum, count, beta):
    """pol_sum, ref_sum, count: [pairs, 2] (chosen, rejected). Returns the mean loss, its gradient
    with respect to pol_sum, and the logged metrics."""
    pol, ref = pol_sum / count, ref_sum / count                     # average log-prob per token
    z = (pol[:, 0] - pol[:, 1]) - (ref[:, 0] - ref[:, 1])
    losses = np.logaddexp(0.0, -beta * z)                           # -log sigmoid(beta z)
    n = len(z)
    dz = -beta / (1.0 + np.exp(beta * z)) / n                       # d mean(loss) / dz
    grad = np.stack([dz / count[:, 0], -dz / count[:, 1]], axis=1)
    cr, rr = beta * (pol[:, 0] - ref[:, 0]), beta * (pol[:, 1] - ref[:, 1])
    metrics = {"loss": losses.mean(), "rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
               "rewards/accuracy": (cr > rr).mean(), "rewards/margin": (cr - rr).mean(),
               "logps/chosen": pol[:, 0].mean(), "logps/rejected": pol[:, 1].mean(),
               "rewards/average": ((cr + rr) / 2).mean(), "logps/accuracy": (pol[:, 0] > pol[:, 1]).mean()}
    return losses.mean(), grad, metrics


def test_dpo_norm_loss_grad_and_metrics_equal_numpy_oracle():
    rng = np.random.default_rng(0)
    P = 16
    count = rng.integers(1, 200, size=(P, 2)).astype(np.float64)
    pol = -rng.uniform(0.5, 3.0, size=(P, 2)) * count
    ref = pol + rng.normal(0, 0.05, size=(P, 2)) * count             # reference close to the policy

    def mean_loss(s):
        t = dpo.pair_terms("dpo_norm", BETA, s, jnp.asarray(count.reshape(-1), jnp.float32),
                           jnp.asarray(ref.reshape(-1), jnp.float32))
        return jnp.mean(t["loss"]), t

    (loss, terms), grad = jax.value_and_grad(mean_loss, has_aux=True)(jnp.asarray(pol.reshape(-1), jnp.float32))
    want_loss, want_grad, want = oracle_dpo_norm(pol, ref, count, BETA)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad).reshape(P, 2), want_grad, rtol=2e-4, atol=1e-9)
    for k, v in want.items():
        np.testing.assert_allclose(float(jnp.mean(terms[k])), v, rtol=1e-4, atol=1e-6, err_msg=k)
    # dpo (unnormalised) differs exactly by the reduction: sums instead of means (open-instruct's
    # _get_batch_logps(average_log_prob=False)), whatever the token counts it is given. (Given counts
    # of 1, as this test did, it could have divided by them and passed.)
    def sum_loss(s):
        t = dpo.pair_terms("dpo", BETA, s, jnp.asarray(count.reshape(-1), jnp.float32),
                           jnp.asarray(ref.reshape(-1), jnp.float32))
        return jnp.mean(t["loss"]), t

    (loss, terms), grad = jax.value_and_grad(sum_loss, has_aux=True)(jnp.asarray(pol.reshape(-1), jnp.float32))
    want_loss, want_grad, want = oracle_dpo_norm(pol, ref, np.ones_like(count), BETA)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad).reshape(P, 2), want_grad, rtol=2e-4, atol=1e-9)
    for k, v in want.items():
        np.testing.assert_allclose(float(jnp.mean(terms[k])), v, rtol=1e-4, atol=1e-6, err_msg=k)


def test_policy_equal_to_its_reference_is_log_2_with_no_reward_accuracy():
    """Before any DPO step the policy is its reference: every reward is 0, so the loss is log 2,
    the margin 0 and open-instruct's accuracy (chosen_rewards > rejected_rewards, strict) 0."""
    rng = np.random.default_rng(1)
    count = rng.integers(1, 50, size=8).astype(np.float32)
    sums = jnp.asarray(-rng.uniform(0.5, 3.0, size=8) * count, jnp.float32)
    for loss in ("dpo", "dpo_norm"):
        t = dpo.pair_terms(loss, BETA, sums, jnp.asarray(count), sums)
        np.testing.assert_allclose(np.asarray(t["loss"]), np.log(2.0), rtol=1e-6)
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
            assert not np.asarray(t[k]).any(), (loss, k)


def test_a_side_with_no_trained_target_is_length_normalised_to_zero_not_nan():
    """dpo_norm divides a row's log-prob sum by its trained targets; a row with none (sum 0)
    counts as log-prob 0, not 0 / 0 (open-instruct's _get_batch_logps would give NaN: one pair
    would poison the batch's loss and every reward metric)."""
    sums, counts, ref = (jnp.asarray(x, jnp.float32) for x in ([-3.0, 0.0], [5.0, 0.0], [-2.5, 0.0]))
    t = dpo.pair_terms("dpo_norm", BETA, sums, counts, ref)
    chosen = BETA * (-3.0 / 5 - -2.5 / 5)
    np.testing.assert_allclose(np.asarray(t["loss"]), [np.logaddexp(0.0, -chosen)], rtol=1e-6)
    assert np.asarray(t["rewards/rejected"]).tolist() == [0.0]
    assert all(np.isfinite(np.asarray(v)).all() for v in t.values())


def test_evaluate_pairs_means_every_pair_once_and_no_filler(tmp_path):
    """Held-out pairs: 7 pairs in batches of 2 pairs (the last one half filler) give the oracle's
    means over exactly the 7 pairs. logps_fn is a stand-in whose per-row (sum, count) are known:
    sum = -(sum of the trained target ids) / 1000, count = trained targets (label_mask[t + 1])."""
    write_pairs(tmp_path, synthetic_pairs(7, seed=5), max_seq_length=32)
    ds = PairDataset(tmp_path, seq_len=32)

    def row_stats(tokens, mask):
        target = mask[:, 1:]
        return -(tokens[:, 1:] * target).sum(1) / 1000.0, target.sum(1).astype(np.float64)

    def logps_fn(model, batch):
        assert batch["tokens"].shape == (4, 32)
        return row_stats(np.asarray(batch["tokens"], np.int64), np.asarray(batch["label_mask"]))

    pol, count = (np.stack([row_stats(ds[i]["tokens"].astype(np.int64), ds[i]["label_mask"])[k] for i in range(7)])
                  for k in (0, 1))                                    # [pairs, 2] each
    ref = pol + np.random.default_rng(6).normal(0, 0.3, size=pol.shape) * count
    import olmo3
    model = olmo3.OLMo3(olmo3.Config.tiny(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8,
                                          mlp_hidden=32, n_layers=4), jax.random.key(0))   # never run
    got = dpo.evaluate_pairs(logps_fn, model, ds, ref.reshape(-1), loss="dpo_norm", beta=BETA, rows=4)
    want = oracle_dpo_norm(pol, ref, count, BETA)[2]
    assert set(want) <= set(got)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)   # float32 sums


@pytest.mark.parametrize("chunk", [8, 10])
def test_sequence_logps_count_targets_not_mask_positions(chunk):
    """sequence_logps against a float64 numpy log-softmax of the model's own logits, with label
    masks that are set on position 0 (no position predicts it) and on the last position: the sum
    and count run over targets t + 1 with label_mask[t + 1] (open-instruct `_get_batch_logps`).
    Chunk 10: 48 positions end in a padded chunk, whose padding must come after the labels."""
    import olmo3
    model = olmo3.OLMo3(olmo3.Config.tiny(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8,
                                          mlp_hidden=32, n_layers=4, window=4), jax.random.key(2))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, size=(4, 12)).astype(np.int32)
    mask = rng.random((4, 12)) < 0.6
    mask[:, 0] = True
    mask[0] = True
    sums, counts = dpo.sequence_logps(model, jnp.asarray(tokens), jnp.asarray(mask), chunk=chunk)
    logp = log_softmax64(eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, jnp.asarray(tokens)))
    target = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]        # (B, T - 1)
    np.testing.assert_array_equal(np.asarray(counts), mask[:, 1:].sum(1))
    np.testing.assert_allclose(np.asarray(sums), (target * mask[:, 1:]).sum(1), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Against transformers: per-sequence log-probs and the gradient through the whole model
# --------------------------------------------------------------------------------------------
def hf_pairs(vocab, T=24, pairs=2, seed=0):
    """Rows chosen/rejected: a shared prompt (mask False), a response (mask True), then padding 0."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((2 * pairs, T), np.int64)
    mask = np.zeros((2 * pairs, T), bool)
    for i in range(pairs):
        prompt = rng.integers(1, vocab, size=rng.integers(3, 8))
        for j in range(2):
            resp = rng.integers(1, vocab, size=rng.integers(2, T - len(prompt) + 1))
            seq = np.concatenate([prompt, resp])
            tokens[2 * i + j, :len(seq)] = seq
            mask[2 * i + j, len(prompt):len(seq)] = True
    return tokens, mask


def test_sequence_logps_and_dpo_gradient_equal_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from olmo3 import hf
    cfg = transformers.Olmo3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, sliding_window=6, pad_token_id=None, eos_token_id=None,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    ref_model = transformers.Olmo3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    tokens, mask = hf_pairs(cfg.vocab_size)
    ref_sums = np.random.default_rng(1).normal(-40, 5, size=len(tokens))

    # transformers: log_softmax of logits[:, :-1] gathered at tokens[:, 1:], masked by mask[:, 1:]
    logits = ref_model(torch.tensor(tokens)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(tokens[:, 1:, None])).squeeze(-1)
    m = torch.tensor(mask[:, 1:], dtype=torch.float32)
    t_sums, t_counts = (logp * m).sum(-1), m.sum(-1)
    avg, ref_avg = t_sums / t_counts, torch.tensor(ref_sums, dtype=torch.float32) / t_counts
    z = (avg[0::2] - avg[1::2]) - (ref_avg[0::2] - ref_avg[1::2])
    t_loss = -torch.nn.functional.logsigmoid(BETA * z).mean()
    t_loss.backward()

    model = hf.from_hf({k: v.detach() for k, v in ref_model.state_dict().items()}, hf.config_from_hf(cfg.to_dict()))

    def loss_fn(model):
        sums, counts = dpo.sequence_logps(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), chunk=16)
        terms = dpo.pair_terms("dpo_norm", BETA, sums, counts, jnp.asarray(ref_sums, jnp.float32))
        return jnp.mean(terms["loss"]), (sums, counts)

    (loss, (sums, counts)), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(model)
    np.testing.assert_array_equal(np.asarray(counts), t_counts.numpy())
    np.testing.assert_allclose(np.asarray(sums), t_sums.detach().numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(float(loss), float(t_loss.detach()), rtol=1e-5)
    named = dict(ref_model.named_parameters())
    pairs = [(grads.lm_head, named["lm_head.weight"].grad.T), (grads.embed, named["model.embed_tokens.weight"].grad),
             (grads.layers.q_proj[1], named["model.layers.1.self_attn.q_proj.weight"].grad.T),
             (grads.layers.down_proj[3], named["model.layers.3.mlp.down_proj.weight"].grad.T)]
    for ours, theirs in pairs:
        theirs = theirs.numpy()
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5 * np.abs(theirs).max(), rtol=1e-3)


# --------------------------------------------------------------------------------------------
# Pair data: written, read, ordered exactly once by the loader
# --------------------------------------------------------------------------------------------
def synthetic_pairs(n, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=rng.integers(2, 6))
        sides = []
        for _ in range(2):
            resp = rng.integers(0, vocab, size=rng.integers(1, 10))
            ids = np.concatenate([prompt, resp, [data.EOS_ID]])
            sides.append((ids, np.arange(len(ids)) >= len(prompt)))
        out.append(tuple(sides))
    return out


def test_pairs_round_trip_and_loader_reads_each_pair_once(tmp_path):
    pairs = synthetic_pairs(24)
    pairs.insert(5, ((np.array([1, 2, 3]), np.zeros(3, bool)), pairs[0][1]))   # nothing to train: dropped
    manifest = write_pairs(tmp_path, pairs, max_seq_length=12)
    assert manifest["pairs"] == 24 and manifest["dropped"] == 1
    ds = PairDataset(tmp_path, seq_len=16)
    kept = pairs[:5] + pairs[6:]
    for i in (0, 7, 23):
        item = ds[i]
        for j in range(2):
            ids, m = kept[i][j][0][:12], kept[i][j][1][:12]        # truncated at prepare time
            np.testing.assert_array_equal(item["tokens"][j, :len(ids)], ids)
            np.testing.assert_array_equal(item["label_mask"][j, :len(ids)], m)
            assert (item["tokens"][j, len(ids):] == data.PAD_ID).all() and not item["label_mask"][j, len(ids):].any()
    ds.attach_reference(np.arange(48, dtype=np.float32).reshape(24, 2))
    for ranks in (1, 2, 4):
        seen = []
        for step in range(3):    # 24 pairs / 8 per step: one epoch
            for r in range(ranks):
                b = data.get_batch(ds, 8, 7, step, r, ranks)
                assert b["tokens"].shape == (2 * 8 // ranks, 16) and b["tokens"].dtype == np.int32
                refs = b["ref_logps"].reshape(-1, 2)
                assert (refs[:, 1] == refs[:, 0] + 1).all()        # row 2i chosen, 2i + 1 rejected
                seen += (refs[:, 0] // 2).astype(int).tolist()
        assert sorted(seen) == list(range(24)), ranks
    # Loader state carries the pair data's fingerprint: a rebuilt data set is refused on resume.
    state = data.Loader(ds, 8, 7, workers=0).state()
    write_pairs(tmp_path / "other", synthetic_pairs(24, seed=1), max_seq_length=12)
    with pytest.raises(ValueError, match="fingerprint"):
        data.Loader.from_state(PairDataset(tmp_path / "other", seq_len=16), state)


def test_pair_dataset_bounds_fingerprint_and_reference(tmp_path):
    """The pair set's own checks: the index range, the vocabulary (dolma2's last id is a token,
    its size is not), the reference's shape and float32 sums (a log-prob sum of -1234.567 is not
    a float16), a fingerprint that sees each mask and seq_len (the reference cache and loader
    state are keyed on it), a mask byte changed in place, seq_len and the manifest's format."""
    one = lambda last, mask=(0, 1, 1): [(([1, 2, last], list(mask)), ([1, 4, 5], [0, 0, 1]))]  # noqa: E731
    write_pairs(tmp_path / "p", one(3), max_seq_length=8)
    ds = PairDataset(tmp_path / "p", 8)
    with pytest.raises(IndexError):
        ds[1]
    assert ds[-1]["tokens"][0, :3].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"reference log-probs of shape \(1, 3\) for 1 pairs"):
        ds.attach_reference(np.zeros((1, 3)))
    ds.attach_reference(np.array([[-1234.567, -2345.678]]))
    assert ds[0]["ref_logps"].dtype == np.float32 and ds[0]["ref_logps"].tolist() == \
        np.float32([-1234.567, -2345.678]).tolist()
    write_pairs(tmp_path / "last", one(data.VOCAB_SIZE - 1), max_seq_length=8)
    PairDataset(tmp_path / "last", 8)[0]
    write_pairs(tmp_path / "past", one(data.VOCAB_SIZE), max_seq_length=8)
    with pytest.raises(ValueError, match=f"token id {data.VOCAB_SIZE} >= vocab size .* another tokenizer"):
        PairDataset(tmp_path / "past", 8)[0]
    write_pairs(tmp_path / "mask", one(3, (0, 0, 1)), max_seq_length=8)
    assert len({PairDataset(tmp_path / "p", 8).fingerprint, PairDataset(tmp_path / "p", 6).fingerprint,
                PairDataset(tmp_path / "mask", 8).fingerprint}) == 3
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        PairDataset(tmp_path / "p", 1)
    masks = tmp_path / "p" / preference.MASKS
    masks.write_bytes(bytes([masks.read_bytes()[0] ^ 1]) + masks.read_bytes()[1:])
    with pytest.raises(ValueError, match=r"labels_mask\.npy: its sha256 differs from the one pairs\.json recorded"):
        PairDataset(tmp_path / "p", 8)
    manifest = tmp_path / "mask" / preference.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": "v0"}))
    with pytest.raises(ValueError, match=f"is not a '{preference.FORMAT}' manifest"):
        PairDataset(tmp_path / "mask", 8)


@pytest.mark.parametrize("chosen, max_seq_length, says", [
    (([1, 2, 3, 4], [-100, -100, 3, 4]), 8, r"the label mask holds \[-100, 3, 4\]; it must be 0 / 1"),  # open-instruct labels
    (([1, 2, 3], [0, 1, 1]), -1, r"max_seq_length=-1 must be a whole number >= 1"),   # cut a token off each side
    (([[1, 2, 3]], [[0, 1, 1]]), 8, r"token ids \(1, 3\) and label mask \(1, 3\) must be 1-D"),  # refused only on reading
    (([1.7, 2.2], [0, 1]), 8, r"token ids must be whole numbers .*float64"),           # written as 1, 2
    (([1, -5], [0, 1]), 8, r"token ids must be whole numbers .*-5 to 1"),              # written as 4294967291
], ids=["labels_as_mask", "negative_length", "two_dimensional", "float_ids", "negative_id"])
def test_write_pairs_refuses_what_it_would_store_wrong(chosen, max_seq_length, says, tmp_path):
    with pytest.raises(ValueError, match=says):
        write_pairs(tmp_path / "out", [(chosen, ([1, 2, 5], [0, 1, 1]))], max_seq_length=max_seq_length)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_a_rewrite_that_dies_before_its_manifest_leaves_no_old_manifest(tmp_path, monkeypatch):
    """Over an existing pair set: the old pairs.json goes before the new files are renamed in, so
    a crash before the new manifest leaves no set that reads as whole with the old one's counts."""
    write_pairs(tmp_path, synthetic_pairs(6), max_seq_length=32)
    def disk_full(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(preference.atomic, "write_json", disk_full)
    with pytest.raises(OSError, match="disk full"):
        write_pairs(tmp_path, synthetic_pairs(6, seed=2), max_seq_length=32)
    with pytest.raises(FileNotFoundError, match="pairs.json does not exist"):
        PairDataset(tmp_path, seq_len=16)


def test_bytes_changed_in_place_are_refused(tmp_path):
    """A token changed in place keeps every size and the recorded sha256, so the fingerprint (and the
    reference cache keyed on it) passed it: a stale reference trained silently. Opening checks the bytes."""
    write_pairs(tmp_path, synthetic_pairs(6), max_seq_length=32)
    PairDataset(tmp_path, seq_len=16)
    with open(tmp_path / preference.TOKENS, "r+b") as f:
        first = f.read(4)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]) + first[1:])
    with pytest.raises(ValueError, match=r"token_ids\.npy: its sha256 differs from the one pairs\.json recorded"):
        PairDataset(tmp_path, seq_len=16)


def test_a_directory_of_sft_data_is_named_as_such(tmp_path):
    """train.py --stage=dpo --data=<an SFT directory>: the line names the flag and what the
    directory holds (it said to write pairs into that non-empty directory, which prepare_dpo refuses)."""
    np.zeros(4, np.uint32).tofile(tmp_path / "token_ids_part_0000.npy")
    with pytest.raises(FileNotFoundError, match=re.escape(f"--data={str(tmp_path)!r} holds SFT data "
                                                          "(token_ids_part_*.npy), not preference pairs")):
        PairDataset(tmp_path, seq_len=16, flag="--data")
    with pytest.raises(FileNotFoundError, match=re.escape(f"--dpo_heldout={str(tmp_path / 'x')!r} holds no prepared")):
        PairDataset(tmp_path / "x", seq_len=16, flag="--dpo_heldout")


def test_truncation_that_leaves_nothing_to_train_is_refused(tmp_path):
    long_prompt = ((np.arange(30), np.arange(30) >= 25), (np.arange(30), np.arange(30) >= 25))
    write_pairs(tmp_path, [long_prompt], max_seq_length=64)
    with pytest.raises(ValueError, match="max_seq_length=16"):
        PairDataset(tmp_path, seq_len=16)


def test_pairs_longer_than_seq_len_keep_their_first_seq_len_tokens(tmp_path):
    """A side longer than --seq_len keeps exactly its first seq_len tokens and mask values (open-instruct
    truncates to max_seq_length); a response whose first trained token is the last kept one still
    trains it (position seq_len - 2 predicts it), so the pair is kept, not refused."""
    ids = np.arange(100, 130)
    edge = ((ids, np.arange(30) >= 15), (ids + 100, np.arange(30) >= 3))   # chosen trains from token 15 on
    write_pairs(tmp_path, [edge], max_seq_length=64)
    item = PairDataset(tmp_path, seq_len=16)[0]
    for j, (t, m) in enumerate(edge):
        np.testing.assert_array_equal(item["tokens"][j], t[:16])
        np.testing.assert_array_equal(item["label_mask"][j], m[:16])
    assert item["label_mask"][0].sum() == 1


# --------------------------------------------------------------------------------------------
# The reference cache: fingerprinted by the reference's weights, the data and seq_len
# --------------------------------------------------------------------------------------------
def test_reference_cache_rejects_changed_reference_data_or_seq_len(tmp_path):
    import olmo3

    def tiny_model(**precision):
        return olmo3.OLMo3(olmo3.Config.tiny(vocab_size=128, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8,
                                             mlp_hidden=32, n_layers=4, **precision), jax.random.key(0))
    model = tiny_model()
    write_pairs(tmp_path / "a", synthetic_pairs(6), max_seq_length=32)
    write_pairs(tmp_path / "b", synthetic_pairs(6, seed=3), max_seq_length=32)
    ds = PairDataset(tmp_path / "a", seq_len=32)
    ident = reference.weights_identity(model)
    fp = reference.fingerprint(ident, ds.fingerprint, ds.seq_len)
    path = reference.default_path(ds.directory)
    sums = np.arange(12, dtype=np.float32).reshape(6, 2)
    calls = []
    got, fresh = reference.load_or_compute(path, fp, lambda: calls.append(1) or (sums, np.ones((6, 2))))
    assert fresh and calls == [1]
    got2, fresh2 = reference.load_or_compute(path, fp, lambda: calls.append(1) or (sums, np.ones((6, 2))))
    assert not fresh2 and calls == [1]
    np.testing.assert_array_equal(got2, sums)
    # Same weights under another name or layout: same identity. One changed bit: another.
    assert reference.weights_identity(jax.tree.map(lambda x: x + 0, model)) == ident
    bumped = jax.tree.map(lambda x: x, model)
    flip = eqx.tree_at(lambda m: m.layers.q_proj, bumped,
                       bumped.layers.q_proj.at[2, 3, 4].set(jnp.nextafter(bumped.layers.q_proj[2, 3, 4], 1.0)))
    swap = eqx.tree_at(lambda m: m.layers.q_proj, bumped, bumped.layers.q_proj[::-1])   # same bits, moved
    # The same weights scoring in bf16 or through float8: other log-probs, so another identity.
    for other in (flip, swap, tiny_model(compute_dtype="bfloat16"), tiny_model(float8=True)):
        other_fp = reference.fingerprint(reference.weights_identity(other), ds.fingerprint, ds.seq_len)
        with pytest.raises(UserError, match="reference_logps.npz.*delete it"):
            reference.load(path, other_fp)
    for other_fp in (reference.fingerprint(ident, PairDataset(tmp_path / "b", seq_len=32).fingerprint, 32),
                     reference.fingerprint(ident, PairDataset(tmp_path / "a", seq_len=24).fingerprint, 24),
                     reference.fingerprint(ident, ds.fingerprint, 24)):   # seq_len keys the cache on its own too
        with pytest.raises(UserError, match=str(path)):
            reference.load(path, other_fp)
    # An empty or cut-short cache (a full disk, a copy interrupted): named, with the fix, exit 2.
    whole = open(path, "rb").read()
    for damaged in (b"", whole[:len(whole) // 2]):
        open(path, "wb").write(damaged)
        with pytest.raises(UserError, match=re.escape(str(path)) + ".*unreadable.*delete it to recompute"):
            reference.load(path, fp)


def test_reference_cache_is_written_whole_and_by_the_writing_process_only(tmp_path, monkeypatch):
    """load_or_compute(write_file=False) (every process but the writer) computes and writes
    nothing; a write that dies part-way (a full disk) leaves neither a cache nor a temporary file,
    so the next run recomputes instead of stopping on a damaged one; a whole write holds the
    fingerprint, the sums as float32 and the counts as int32."""
    path = str(tmp_path / reference.CACHE_NAME)
    sums, counts = np.array([[-1.5, -2.25], [-3.0, -4.0]]), np.array([[3, 4], [5, 6]])
    got, fresh = reference.load_or_compute(path, "fp", lambda: (sums, counts), write_file=False)
    assert fresh and got.dtype == np.float32 and os.listdir(tmp_path) == []
    np.testing.assert_array_equal(got, sums)

    def full_disk(file, **arrays):
        with open(file, "wb") as f:
            f.write(b"PK\x03\x04 the first bytes of a zip")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(OSError, match="No space left"):
        reference.load_or_compute(path, "fp", lambda: (sums, counts))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [] and reference.load(path, "fp") is None
    got, fresh = reference.load_or_compute(path, "fp", lambda: (sums, counts))
    assert fresh and os.listdir(tmp_path) == [reference.CACHE_NAME]
    with np.load(path) as z:
        assert str(z["fingerprint"]) == "fp" and z["sums"].dtype == np.float32 and z["counts"].dtype == np.int32
        np.testing.assert_array_equal(z["sums"], sums)
        np.testing.assert_array_equal(z["counts"], counts)
    assert reference.load_or_compute(path, "fp", lambda: pytest.fail("recomputed"))[1] is False


# --------------------------------------------------------------------------------------------
# The sharded step: the same update on any mesh and microbatching (DESIGN §4, bug 4)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("meshes", [
    [("data:2,fsdp:4", 2)],
    pytest.param([("fsdp:8", 1), ("data:2,fsdp:4", 2)],   # three compiles of an 8-device step: minutes on 2 busy cores
                 marks=pytest.mark.slow),
], ids=["data2_fsdp4", "both"])
def test_sharded_step_is_topology_independent_and_equals_plain_gradient(meshes):
    """The DPO step on a mesh against the plain gradient of the same loss: its loss, the gradient
    norm it clips by (a mean over each device's pairs instead of over all of them scaled it by the
    device count, and the first unclipped Adam step, g / (|g| + eps), cannot see a scale), and the
    update; with the slow case, two meshes against each other."""
    import olmo3
    from olmo3 import optim, schedules, sharding
    from olmo3.model import decay_mask
    cfg = olmo3.Config.tiny(vocab_size=128, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, mlp_hidden=32,
                            n_layers=4, window=4)
    model = olmo3.OLMo3(cfg, jax.random.key(0))
    tokens, mask = hf_pairs(cfg.vocab_size, T=16, pairs=16, seed=3)
    batch = {"tokens": tokens.astype(np.int32), "label_mask": mask,
             "ref_logps": np.random.default_rng(4).normal(-30, 3, size=32).astype(np.float32)}
    opt = optim.SkipStepAdamW(schedules.constant_schedule(1e-3), b2=0.999, weight_decay=0.0, decay_mask=decay_mask,
                              max_grad_norm=1e9, skip_steps=False)

    def plain_loss(m):
        s, c = dpo.sequence_logps(m, jnp.asarray(batch["tokens"]), jnp.asarray(mask), chunk=32)
        return jnp.mean(dpo.pair_terms("dpo_norm", BETA, s, c, jnp.asarray(batch["ref_logps"]))["loss"])

    want_loss, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(plain_loss))(model)
    want_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                                  for g in jax.tree.leaves(eqx.filter(want_grads, eqx.is_inexact_array)))))
    results = []
    for spec, micro in meshes:
        mesh = sharding.make_mesh(spec)
        m, o = sharding.shard_state(model, opt.init(model), mesh)
        step = dpo.make_train_step(opt, mesh, sharding.param_specs(m, mesh), microbatches=micro, chunk=32)
        m, o, metrics = step(m, o, sharding.global_batch(batch, mesh))
        np.testing.assert_allclose(float(metrics["train/loss"]), float(want_loss), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["optim/grad_norm"]), want_norm, rtol=1e-4)
        results.append(m)
    # First Adam step with no clipping: every parameter moves by lr * sign-like g / (|g| + eps); compare
    # the meshes with each other and with the plain gradient's update direction.
    for a, g, p0, *others in zip(jax.tree.leaves(results[0]), jax.tree.leaves(eqx.filter(want_grads, eqx.is_inexact_array)),
                                 jax.tree.leaves(model), *(jax.tree.leaves(r) for r in results[1:])):
        for b in others:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
        expect = np.asarray(p0) - 1e-3 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8)
        np.testing.assert_allclose(np.asarray(a), expect, atol=2e-5)


@pytest.mark.parametrize("template", ["olmo_thinker_no_think_7b", "olmo3_instruct"])
def test_prepare_dpo_trains_the_last_message_only(tmp_path, template):
    """open-instruct's DPO (`preference_tulu_tokenize_and_truncate_v1` -> `_v1_2` ->
    `last_turn_tulu_tokenize_and_truncate_v1`) masks every message but the last, earlier assistant
    turns included: the trained tokens are what follows the generation prompt after the prompt
    messages. (Every assistant turn was trained here, so the shared earlier turns entered the
    length-normalised dpo_norm loss of both sides.)"""
    import json

    from data import chat
    from data.prepare_dpo import prepare_dpo
    prompt = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
              {"role": "user", "content": "And 3+3?"}]
    row = {"chosen": [*prompt, {"role": "assistant", "content": "6"}],
           "rejected": [*prompt, {"role": "assistant", "content": "7"}]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    prepare_dpo(str(tmp_path / "pairs.jsonl"), str(tmp_path / "out"), template, max_seq_length=256)
    ds = PairDataset(tmp_path / "out", seq_len=256)
    start = len(chat.encode(prompt, template, add_generation_prompt=True))
    for j, side in enumerate(("chosen", "rejected")):
        n = len(chat.encode(row[side], template))
        want = np.zeros(256, bool)
        want[start:n] = True
        np.testing.assert_array_equal(ds[0]["label_mask"][j], want)
        assert data.dolma2().decode(ds[0]["tokens"][j, start:n].tolist()).startswith(row[side][-1]["content"])


def test_prepare_dpo_warns_of_pairs_that_train_nothing(tmp_path, caplog):
    """A pair whose chosen and rejected messages are the same is kept (open-instruct keeps it)
    but said: it used to train silently at loss log 2 with a zero gradient. So is one whose two
    sides answer different prompts."""
    import json

    from data.prepare_dpo import prepare_dpo
    same = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    other = [same[0], {"role": "assistant", "content": "Go away."}]
    elsewhere = [{"role": "user", "content": "Bye."}, other[1]]   # another prompt: a misaligned join
    tagged = [{**same[0], "id": 7}, other[1]]   # a key no template renders: the same prompt
    rows = [{"chosen": same, "rejected": other}, {"chosen": same, "rejected": same},
            {"chosen": same, "rejected": elsewhere}, {"chosen": same, "rejected": tagged},
            {"chosen": [{**same[0], "id": 1}, same[1]], "rejected": [{**same[0], "id": 2}, same[1]]},  # same tokens
            {"chosen": same, "rejected": [elsewhere[0], same[1]]}]   # one answer to two prompts: not the same pair
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        m = prepare_dpo(str(tmp_path / "p.jsonl"), str(tmp_path / "out"), "olmo", max_seq_length=256)
    assert m["pairs"] == 6 and "2 pair(s) have the same chosen and rejected messages (first: pair 2)" in caplog.text
    assert "2 pair(s) have different prompts (the messages before the final answer) on the chosen and rejected " \
           "sides (first: pair 3)" in caplog.text
    assert "have a side with no turn before its answer" not in caplog.text
    pair = PairDataset(tmp_path / "out", seq_len=256)[4]
    np.testing.assert_array_equal(pair["tokens"][0], pair["tokens"][1])
    # olmo3_instruct renders a system turn's tool definitions: two sides whose tools differ answer
    # different prompts
    tools = [{"role": "system", "content": "S", "functions": json.dumps([{"name": name}])} for name in "fg"]
    (tmp_path / "t.jsonl").write_text(json.dumps({"chosen": [tools[0], *same], "rejected": [tools[1], *other]}) + "\n")
    caplog.clear()
    with caplog.at_level("WARNING"):
        prepare_dpo(str(tmp_path / "t.jsonl"), str(tmp_path / "out_t"), "olmo3_instruct", max_seq_length=512)
    assert "1 pair(s) have different prompts" in caplog.text


def test_prepare_dpo_says_when_a_side_is_its_answer_alone(tmp_path, caplog):
    """A side of only the answer is trained whole, the template's system turn included (open-instruct
    masks no turn: there is none): kept and said. With a "prompt" list beside it, the line is TRL's
    explicit-prompt format, whose prompt was dropped without a word: refused, naming the line."""
    import json

    from data import chat
    from data.prepare_dpo import prepare_dpo
    user, good, bad = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "good answer"},
                       {"role": "assistant", "content": "bad"})
    (tmp_path / "bare.jsonl").write_text(json.dumps({"chosen": [user, good], "rejected": [user, bad]}) + "\n"
                                         + json.dumps({"chosen": [good], "rejected": [bad]}) + "\n"
                                         + json.dumps({"chosen": [user, good], "rejected": [bad]}) + "\n")
    with caplog.at_level("WARNING"):
        prepare_dpo(str(tmp_path / "bare.jsonl"), str(tmp_path / "out"), "olmo", max_seq_length=256)
    assert "2 pair(s) have a side with no turn before its answer (first: pair 2)" in caplog.text   # either side
    ds = PairDataset(tmp_path / "out", seq_len=256)
    n = len(chat.encode([good], "olmo"))
    assert ds[1]["label_mask"][0, :n].all()   # the whole side, system turn and all
    for rejected in ([bad], [user, bad]):   # either side its answer alone
        (tmp_path / "trl.jsonl").write_text(json.dumps({"prompt": [user], "chosen": [good], "rejected": rejected}) + "\n")
        with pytest.raises(ValueError, match=r"trl.jsonl:1: \"prompt\" holds the prompt turns and a side only its "
                                             r"answer \(TRL's explicit-prompt format\); write each side as the whole"):
            prepare_dpo(str(tmp_path / "trl.jsonl"), str(tmp_path / "out2"), "olmo", max_seq_length=256)
        assert not (tmp_path / "out2").exists()


def test_prepare_dpo_renders_with_the_chat_template_and_names_bad_lines(tmp_path):
    import json

    from data import chat
    from data.prepare_dpo import prepare_dpo
    user = {"role": "user", "content": "Name a prime."}
    rows = [{"chosen": [user, {"role": "assistant", "content": "<think>Seven has no divisor.</think>7"}],
             "rejected": [user, {"role": "assistant", "content": "<think>Eight is even.</think>8"}]}]
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dpo(str(tmp_path / "ok.jsonl"), str(tmp_path / "out"), "olmo_thinker", max_seq_length=128)
    ds = PairDataset(tmp_path / "out", seq_len=128)
    for j, side in enumerate(("chosen", "rejected")):
        ids, mask = chat.encode_with_mask(rows[0][side], "olmo_thinker")
        np.testing.assert_array_equal(ds[0]["tokens"][j, :len(ids)], ids)
        np.testing.assert_array_equal(ds[0]["label_mask"][j, :len(ids)], mask)
        assert ids[-1] == data.EOS_ID and mask[-1]        # the response ends in EOS, trained
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):   # never over a prepared set
        prepare_dpo(str(tmp_path / "ok.jsonl"), str(tmp_path / "out"), "olmo_thinker", max_seq_length=128)
    for bad, why in ((0, "--max_seq_length=0 must be positive"), (3, "within --max_seq_length=3 tokens")):
        with pytest.raises(ValueError, match=why):
            prepare_dpo(str(tmp_path / "ok.jsonl"), str(tmp_path / f"cut{bad}"), "olmo_thinker", max_seq_length=bad)
        assert not (tmp_path / f"cut{bad}").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.jsonl", "out"]   # no temporary left behind
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"chosen": rows[0]["chosen"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*rejected"):
        prepare_dpo(str(tmp_path / "bad.jsonl"), str(tmp_path / "out2"), "olmo", max_seq_length=128)
    assert not (tmp_path / "out2").exists()
    for line, why in ((json.dumps({**rows[0], "rejected": []}), r'bad.jsonl:2: "rejected" must be a non-empty list'),
                      (json.dumps({**rows[0], "chosen": [user]}), r"bad.jsonl:2: the last chosen message must be the assistant"),
                      (json.dumps({**rows[0], "chosen": "7"}), r'bad.jsonl:2: "chosen" must be a non-empty list')):
        (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=why):
            prepare_dpo(str(tmp_path / "bad.jsonl"), str(tmp_path / "out2"), "olmo", max_seq_length=128)
    (tmp_path / "bad.jsonl").write_bytes((json.dumps(rows[0]) + "\n").encode() * 2 + b'{"chosen": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not UTF-8 text"):
        prepare_dpo(str(tmp_path / "bad.jsonl"), str(tmp_path / "out2"), "olmo", max_seq_length=128)
    # A damaged manifest of a prepared set: named, with the command that rebuilds it.
    manifest = tmp_path / "out" / "pairs.json"
    text = manifest.read_text()
    for damaged in (text[:len(text) // 2], json.dumps({k: v for k, v in json.loads(text).items() if k != "lengths"})):
        manifest.write_text(damaged)
        with pytest.raises(ValueError, match=re.escape(str(manifest)) + ".*python -m data.prepare_dpo"):
            PairDataset(tmp_path / "out", seq_len=128)
