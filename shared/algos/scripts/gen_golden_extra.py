#!/usr/bin/env python3
"""Writes shared/algos/tests/golden_extra.json: golden cases computed by verl's own reference code.

The cases complement tests/golden/algos_sample.json with what it does not cover: every advantage estimator
(including grpo_vectorized, rloo_vectorized, grpo_passk, gdpo, the optimal token baselines and the V1
multi-trajectory GRPO rule), singleton groups, fully masked rows, every policy loss with IS weights and with
global-batch normalisation (dp_size > 1), the gradient of the policy loss, bypass mode, rollout correction,
and a few float32 cases.

Usage: gen_golden_extra.py VERL_CHECKOUT [OUT.json]
VERL_CHECKOUT is a verl-project/verl work tree; only core_algos.py, rollout_corr_helper.py, torch_functional.py
and groupwise.py are imported, with small stubs for verl's config classes (no ray/omegaconf needed).
Needs torch and numpy.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch


def load_verl(checkout):
    root = tempfile.mkdtemp(prefix="verlref-")
    files = [
        "verl/trainer/ppo/core_algos.py",
        "verl/trainer/ppo/rollout_corr_helper.py",
        "verl/utils/torch_functional.py",
        "verl/utils/groupwise.py",
    ]
    for rel in files:
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        shutil.copy(os.path.join(checkout, rel), os.path.join(root, rel))
    stubs = {
        "verl/__init__.py": "",
        "verl/trainer/__init__.py": "",
        "verl/trainer/ppo/__init__.py": "",
        "verl/workers/__init__.py": "",
        "verl/utils/__init__.py": "from .groupwise import as_torch_index, group_mean_std\n",
        "verl/utils/import_utils.py": "def deprecated(*a, **k):\n    return lambda f: f\n",
        "verl/utils/device.py": "def get_device_name():\n    return 'cpu'\n"
        "def get_torch_device():\n    import torch\n    return torch.cpu\n",
        "omegaconf/__init__.py": "import contextlib\nclass DictConfig(dict):\n    pass\n"
        "def open_dict(x):\n    return contextlib.nullcontext()\n",
        "tensordict/__init__.py": "TensorDict = dict\n",
        "verl/trainer/config/__init__.py": "class AlgoConfig(dict):\n    def __getattr__(self, k):\n"
        "        try:\n            return self[k]\n        except KeyError:\n            raise AttributeError(k)\n",
        "verl/trainer/config/algorithm.py": "RolloutCorrectionConfig = dict\n",
        "verl/workers/config/__init__.py": "class _Attr(dict):\n    def __getattr__(self, k):\n"
        "        try:\n            return self[k]\n        except KeyError:\n            raise AttributeError(k)\n"
        "class PolicyLossConfig(_Attr):\n    pass\nclass ActorConfig(_Attr):\n    pass\n",
        "verl/workers/config/actor.py": "from . import PolicyLossConfig\n",
        "verl/protocol.py": "class DataProto:\n    def __init__(self, batch):\n        self.batch = batch\n"
        "    @classmethod\n    def from_dict(cls, tensors):\n        return cls(tensors)\n",
    }
    for rel, text in stubs.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    sys.path.insert(0, root)
    import verl.trainer.ppo.core_algos as core_algos
    import verl.trainer.ppo.rollout_corr_helper as rollout_corr
    import verl.workers.config as workers_config

    return core_algos, rollout_corr, workers_config


def lst(t):
    return t.detach().to(torch.float64).tolist()


def contiguous_mask(gen, bs, t, allow_empty=False):
    lo = 0 if allow_empty else 1
    lengths = torch.randint(lo, t + 1, (bs,), generator=gen)
    return (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)


def holey_mask(gen, bs, t):
    # multi-turn style: valid spans interrupted by tool-output (masked) tokens
    mask = (torch.rand(bs, t, generator=gen, dtype=torch.float64) > 0.3).to(torch.float64)
    mask[:, 0] = 1.0
    return mask


def outcome_rewards(gen, mask, binary=False):
    bs, t = mask.shape
    rewards = torch.zeros(bs, t, dtype=torch.float64)
    lengths = mask.sum(-1).long()
    for i in range(bs):
        pos = max(int(lengths[i]) - 1, 0)
        if binary:
            rewards[i, pos] = float(torch.randint(0, 2, (1,), generator=gen))
        else:
            rewards[i, pos] = float(torch.randn(1, generator=gen, dtype=torch.float64))
    return rewards


def main():
    checkout = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "tests", "golden_extra.json")
    ca, rc, wc = load_verl(checkout)
    gen = torch.Generator().manual_seed(7)
    cases = []

    def add(fn, name, config, inputs, expected):
        cases.append({"fn": fn, "name": name, "config": config, "inputs": inputs, "expected": expected})

    # ---------------- advantages ----------------
    shapes = [(6, 5), (9, 4), (5, 7)]
    for bs, t in shapes:
        for masks in ("contiguous", "empty_rows", "holes"):
            if masks == "contiguous":
                mask = contiguous_mask(gen, bs, t)
            elif masks == "empty_rows":
                mask = contiguous_mask(gen, bs, t, allow_empty=True)
                mask[1] = 0.0
            else:
                mask = holey_mask(gen, bs, t)
            rewards = outcome_rewards(gen, mask) if masks != "holes" else torch.randn(bs, t, generator=gen, dtype=torch.float64) * mask
            # groups of mixed sizes including a singleton
            index = np.array([f"u{i % 3}" if i < bs - 1 else "solo" for i in range(bs)], dtype=object)
            values = torch.randn(bs, t, generator=gen, dtype=torch.float64)
            gamma, lam = 0.9 + 0.1 * float(torch.rand(1, generator=gen)), 0.8 + 0.2 * float(torch.rand(1, generator=gen))
            base = {"token_level_rewards": lst(rewards), "response_mask": lst(mask)}
            grouped = dict(base, index=list(index))
            a, r = ca.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
            add("advantage", "gae", {"gamma": gamma, "lam": lam}, dict(base, values=lst(values)),
                {"advantages": lst(a), "returns": lst(r)})
            for norm in (True, False):
                a, r = ca.compute_grpo_outcome_advantage(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
                add("advantage", "grpo", {"norm_adv_by_std_in_grpo": norm}, grouped, {"advantages": lst(a), "returns": lst(r)})
                a, r = ca.compute_grpo_vectorized_outcome_advantage(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
                add("advantage", "grpo_vectorized", {"norm_adv_by_std_in_grpo": norm}, grouped,
                    {"advantages": lst(a), "returns": lst(r)})
                a, r = ca.compute_gdpo_outcome_advantage(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
                add("advantage", "gdpo", {"norm_adv_by_std_in_grpo": norm}, grouped, {"advantages": lst(a), "returns": lst(r)})
            for name, fn in [
                ("rloo", ca.compute_rloo_outcome_advantage),
                ("rloo_vectorized", ca.compute_rloo_vectorized_outcome_advantage),
                ("opo", ca.compute_opo_outcome_advantage),
                ("gpg", ca.compute_gpg_outcome_advantage),
                ("reinforce_plus_plus_baseline", ca.compute_reinforce_plus_plus_baseline_outcome_advantage),
            ]:
                a, r = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index, config=ca.AlgoConfig())
                add("advantage", name, {}, grouped, {"advantages": lst(a), "returns": lst(r)})
            a, r = ca.compute_reinforce_plus_plus_outcome_advantage(rewards.clone(), mask, config=ca.AlgoConfig(gamma=gamma))
            add("advantage", "reinforce_plus_plus", {"gamma": gamma}, base, {"advantages": lst(a), "returns": lst(r)})
            baselines = torch.randn(bs, generator=gen, dtype=torch.float64)
            a, r = ca.compute_remax_outcome_advantage(rewards.clone(), baselines, mask)
            add("advantage", "remax", {}, dict(base, reward_baselines=lst(baselines)), {"advantages": lst(a), "returns": lst(r)})
            # pass@k needs >= 2 rows per group
            pk_index = np.array([f"p{i // 2}" for i in range(bs - bs % 2)] + (["p0"] if bs % 2 else []), dtype=object)
            binary = outcome_rewards(gen, mask, binary=True) + 0.01 * torch.arange(bs, dtype=torch.float64)[:, None] * (outcome_rewards(gen, mask) != 0)
            for norm in (True, False):
                a, r = ca.compute_grpo_passk_outcome_advantage(binary.clone(), mask, pk_index,
                                                                config=ca.AlgoConfig(norm_adv_by_std_in_grpo=norm))
                add("advantage", "grpo_passk", {"norm_adv_by_std_in_grpo": norm},
                    {"token_level_rewards": lst(binary), "response_mask": lst(mask), "index": list(pk_index)},
                    {"advantages": lst(a), "returns": lst(r)})
            old = -torch.rand(bs, t, generator=gen, dtype=torch.float64) * 3
            spsq = torch.rand(bs, t, generator=gen, dtype=torch.float64) * 0.5
            isw = 0.5 + torch.rand(bs, t, generator=gen, dtype=torch.float64)
            for name, fn in [("optimal_token_baseline", ca.compute_optimal_token_baseline_advantage),
                             ("tir_optimal_token_baseline", ca.compute_multi_turn_optimal_token_baseline_advantage)]:
                for weights in (None, isw):
                    a, r = fn(rewards.clone(), mask, index, old, spsq, rollout_is_weights=weights)
                    inputs = dict(grouped, old_log_probs=lst(old), sum_pi_squared=lst(spsq))
                    if weights is not None:
                        inputs["rollout_is_weights"] = lst(weights)
                    add("advantage", name, {}, inputs, {"advantages": lst(a), "returns": lst(r)})

    # GDPO with reward components (contiguous masks: verl places each component on the last valid token)
    for bs, t in [(6, 5), (8, 3)]:
        mask = contiguous_mask(gen, bs, t)
        index = np.array([f"g{i % 2}" for i in range(bs)], dtype=object)
        comps = {k: np.round(np.random.RandomState(bs + j).rand(bs), 3) for j, k in enumerate(["format", "accuracy"])}
        prompts = torch.zeros(bs, 2)
        attention = torch.cat([torch.ones(bs, 2), mask], dim=1).long()
        for weights in (None, [0.25, 1.5]):
            cfg = {"gdpo_reward_keys": ["format", "accuracy"]}
            if weights is not None:
                cfg["gdpo_reward_weights"] = weights
            a, r = ca.compute_gdpo_outcome_advantage(torch.zeros(bs, t, dtype=torch.float64), mask, index, config=cfg,
                                                     non_tensor_batch=comps, batch={"prompts": prompts, "attention_mask": attention})
            add("advantage", "gdpo", cfg,
                {"token_level_rewards": lst(torch.zeros(bs, t)), "response_mask": lst(mask), "index": list(index),
                 "extra_scores": {k: v.tolist() for k, v in comps.items()}},
                {"advantages": lst(a), "returns": lst(r)})

    # V1 multi-trajectory GRPO (mirrors verl/trainer/ppo/v1/utils.py around core_algos' GRPO)
    for norm in (True, False):
        keys = ["a_0_0", "a_0_1", "a_1_0", "a_2_0", "a_2_2", "a_2_1", "b_0_0", "b_1_0", "b_1_1", "c_0_0"]
        bs, t = len(keys), 4
        mask = contiguous_mask(gen, bs, t)
        mask[4, 0] = 0.0
        mask[4, 1] = 1.0
        rewards = outcome_rewards(gen, mask)
        finals, row_sessions = {}, []
        for i, key in enumerate(keys):
            uid, session, idx = key.rsplit("_", 2)
            sk = f"{uid}_{session}"
            row_sessions.append(sk)
            if sk not in finals or finals[sk][0] < int(idx):
                finals[sk] = (int(idx), i)
        final_rows = [row for _, row in finals.values()]
        local = {sk: j for j, sk in enumerate(finals)}
        uids = np.array([k.rsplit("_", 2)[0] for k in keys], dtype=object)
        adv, _ = ca.compute_grpo_outcome_advantage(rewards[final_rows].clone(), mask[final_rows], uids[final_rows],
                                                   norm_adv_by_std_in_grpo=norm)
        first = mask[final_rows].argmax(dim=1)
        final_scores = adv[torch.arange(len(final_rows)), first]
        scores = final_scores[[local[sk] for sk in row_sessions]].unsqueeze(-1) * mask
        add("advantage", "grpo", {"norm_adv_by_std_in_grpo": norm},
            {"token_level_rewards": lst(rewards), "response_mask": lst(mask), "keys": keys, "index": list(uids)},
            {"advantages": lst(scores), "returns": lst(scores)})

    # ---------------- policy losses ----------------
    modes = ["vanilla", "gspo", "sapo", "gpg", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro", "clip_cov"]
    agg_modes = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
    case_id = 0
    for bs, t in [(6, 5), (4, 8)]:
        for variant in ("plain", "is_weights", "global", "empty_row"):
            old = -torch.rand(bs, t, generator=gen, dtype=torch.float64) * 3
            new = old + torch.randn(bs, t, generator=gen, dtype=torch.float64) * 0.4
            adv = torch.randn(bs, t, generator=gen, dtype=torch.float64)
            adv[0, :2] = 0.0
            mask = contiguous_mask(gen, bs, t)
            if variant == "empty_row":
                mask[2] = 0.0
            isw = (0.5 + torch.rand(bs, t, generator=gen, dtype=torch.float64)) if variant == "is_weights" else None
            gbi = {}
            if variant == "global":
                gbi = {"dp_size": 2, "batch_num_tokens": float(mask.sum()) * 2 + 3, "global_batch_size": bs * 2 + 1,
                       "loss_scale_factor": 11}
            for mode in modes:
                case_id += 1
                agg = agg_modes[case_id % len(agg_modes)]
                lo, hi = 0.1 + 0.2 * float(torch.rand(1, generator=gen)), 0.1 + 0.25 * float(torch.rand(1, generator=gen))
                pl = {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.2, "clip_cov_ratio": 0.05, "clip_cov_lb": -5.0,
                      "clip_cov_ub": 5.0, "dro_beta": 0.3}
                if mode == "clip_cov":
                    # verl picks the tokens with torch.randperm: make every candidate a pick (ratio 1)
                    pl["clip_cov_ratio"] = 1.0
                cfg = {"clip_ratio": 0.2, "clip_ratio_low": lo, "clip_ratio_high": hi, "clip_ratio_c": 2.5,
                       "tau_pos": 1.1, "tau_neg": 0.9, "loss_agg_mode": agg, "global_batch_info": gbi, "policy_loss": pl}
                config = wc.ActorConfig(cfg)
                config["policy_loss"] = wc.PolicyLossConfig(pl)
                lp = new.clone().requires_grad_(True)
                loss, metrics = ca.get_policy_loss_fn(mode)(old_log_prob=old, log_prob=lp, advantages=adv,
                                                            response_mask=mask, loss_agg_mode=agg, config=config,
                                                            rollout_is_weights=isw)
                loss.backward()
                inputs = {"old_log_prob": lst(old), "log_prob": lst(new), "advantages": lst(adv), "response_mask": lst(mask)}
                if isw is not None:
                    inputs["rollout_is_weights"] = lst(isw)
                expected = {"pg_loss": float(loss.detach()), "grad_log_prob": lst(lp.grad)}
                for k, v in metrics.items():
                    expected[k.split("/")[-1]] = float(v)
                add("policy_loss", mode, cfg, inputs, expected)

    # bypass mode (old = rollout log-probs), both loss types, with rejection sampling
    for loss_type, rs, thr in [("ppo_clip", None, None), ("reinforce", None, None),
                               ("reinforce", "token_k1,seq_max_k2", "0.5_1.8,0.3"), ("ppo_clip", "seq_mean_k3", 0.05)]:
        bs, t = 5, 6
        old = -torch.rand(bs, t, generator=gen, dtype=torch.float64) * 3
        new = old + torch.randn(bs, t, generator=gen, dtype=torch.float64) * 0.3
        adv = torch.randn(bs, t, generator=gen, dtype=torch.float64)
        mask = contiguous_mask(gen, bs, t)
        rcfg = {"rollout_is": "sequence" if loss_type == "reinforce" else "token", "rollout_is_threshold": 1.5,
                "rollout_is_batch_normalize": False, "rollout_rs": rs, "rollout_rs_threshold": thr,
                "loss_type": loss_type}
        pl = {"rollout_correction": rcfg}
        cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
               "loss_agg_mode": "token-mean", "global_batch_info": {}, "policy_loss": pl}
        config = wc.ActorConfig(cfg)
        config["policy_loss"] = wc.PolicyLossConfig(pl)
        lp = new.clone().requires_grad_(True)
        loss, metrics = ca.get_policy_loss_fn("bypass_mode")(old_log_prob=old, log_prob=lp, advantages=adv,
                                                             response_mask=mask, loss_agg_mode="token-mean", config=config)
        loss.backward()
        expected = {"pg_loss": float(loss.detach()), "grad_log_prob": lst(lp.grad)}
        for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
            if k in metrics:
                expected[k.split("/")[-1]] = float(metrics[k])
        add("policy_loss", "bypass_mode", cfg,
            {"old_log_prob": lst(old), "log_prob": lst(new), "advantages": lst(adv), "response_mask": lst(mask)}, expected)

    # ---------------- aggregation, value loss ----------------
    for bs, t in [(5, 4), (3, 9)]:
        for gbi in ({}, {"dp_size": 4, "batch_num_tokens": 37.0, "global_batch_size": 13.0, "loss_scale_factor": 7.0}):
            mat = torch.randn(bs, t, generator=gen, dtype=torch.float64)
            mask = contiguous_mask(gen, bs, t, allow_empty=True)
            mask[0] = 0.0
            for mode in agg_modes:
                m = mat.clone().requires_grad_(True)
                loss = ca.agg_loss(m, mask, mode, **gbi)
                loss.backward()
                add("agg_loss", mode, {"global_batch_info": gbi}, {"loss_mat": lst(mat), "loss_mask": lst(mask)},
                    {"loss": float(loss.detach()), "grad_loss_mat": lst(m.grad)})
            for mode in agg_modes:
                vpreds = torch.randn(bs, t, generator=gen, dtype=torch.float64)
                values = vpreds + torch.randn(bs, t, generator=gen, dtype=torch.float64) * 0.6
                returns = torch.randn(bs, t, generator=gen, dtype=torch.float64)
                v = vpreds.clone().requires_grad_(True)
                loss, clipfrac = ca.compute_value_loss(v, returns, values, mask, 0.3, mode, **gbi)
                loss.backward()
                add("value_loss", "clipped", dict({"cliprange_value": 0.3, "loss_agg_mode": mode}, global_batch_info=gbi),
                    {"vpreds": lst(vpreds), "returns": lst(returns), "values": lst(values), "response_mask": lst(mask)},
                    {"vf_loss": float(loss.detach()), "vf_clipfrac": float(clipfrac), "grad_vpreds": lst(v.grad)})

    # ---------------- KL, logits ----------------
    lp = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 4
    ref = lp + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 8  # reaches k3's clamps
    mask = contiguous_mask(gen, 4, 6)
    for name in ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]:
        x = lp.clone().requires_grad_(True)
        kl = ca.kl_penalty(x, ref, name)
        (kl * mask).sum().backward()
        add("kl_penalty", name, {}, {"logprob": lst(lp), "ref_logprob": lst(ref), "response_mask": lst(mask)},
            {"kl": lst(kl), "grad_logprob_of_masked_sum": lst(x.grad)})
    import verl.utils.torch_functional as F

    logits = torch.randn(3, 4, 17, generator=gen, dtype=torch.float64) * 3
    ids = torch.randint(0, 17, (3, 4), generator=gen)
    add("entropy", "from_logits", {}, {"logits": lst(logits)}, {"entropy": lst(F.entropy_from_logits(logits))})
    add("logprobs", "from_logits", {}, {"logits": lst(logits), "ids": ids.tolist()},
        {"logprobs": lst(F.logprobs_from_logits_v2(logits, ids))})
    # float32 on purpose
    logits32 = logits.float()
    add("entropy", "from_logits", {"dtype": "float32"}, {"logits": lst(logits32)},
        {"entropy": lst(F.entropy_from_logits(logits32))})
    add("logprobs", "from_logits", {"dtype": "float32"}, {"logits": lst(logits32), "ids": ids.tolist()},
        {"logprobs": lst(F.logprobs_from_logits_v2(logits32, ids))})

    # ---------------- rollout correction ----------------
    for rcfg in [
        {"rollout_is": "token", "rollout_is_threshold": 1.6},
        {"rollout_is": "sequence", "rollout_is_threshold": 3.0},
        {"rollout_is": "token", "rollout_is_threshold": "0.7_1.4"},
        {"rollout_is": "sequence", "rollout_is_threshold": "0.2_5.0", "rollout_is_batch_normalize": True},
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True},
        {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": 1.3},
        {"rollout_is": None, "rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "0.02,0.03"},
        {"rollout_is": "token", "rollout_rs": "seq_sum_k1,seq_mean_k2,seq_max_k3", "rollout_rs_threshold": "0.4_2.5,0.02,0.05"},
        {"rollout_is": None, "rollout_rs": "seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k3,seq_max_k2",
         "rollout_rs_threshold": "0.08,0.08,1.1,0.01,0.02"},
    ]:
        bs, t = 6, 5
        old = -torch.rand(bs, t, generator=gen, dtype=torch.float64) * 3
        rollout = old + torch.randn(bs, t, generator=gen, dtype=torch.float64) * 0.25
        mask = contiguous_mask(gen, bs, t, allow_empty=True)
        mask[0] = 1.0
        mask[3] = 0.0
        full = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                "rollout_rs": None, "rollout_rs_threshold": None}
        full.update(rcfg)
        weights, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, full["rollout_is"], full["rollout_is_threshold"], full["rollout_is_batch_normalize"],
            full["rollout_rs"], full["rollout_rs_threshold"])
        expected = {"response_mask": lst(new_mask)}
        if weights is not None:
            expected["rollout_is_weights"] = lst(weights.batch["rollout_is_weights"])
        for k, v in metrics.items():
            if any(s in k for s in ("_std", "_seq_mean", "_seq_std", "_seq_max", "_seq_min", "_seq_fraction")) and "rollout_rs_" in k:
                continue  # jetrl does not report these per-criterion rejection statistics
            expected[k] = float(v)
        add("rollout_correction", "compute", {"rollout_correction": {k: v for k, v in full.items()}},
            {"old_log_prob": lst(old), "rollout_log_prob": lst(rollout), "response_mask": lst(mask)}, expected)

    # ---------------- KL controller ----------------
    for coef, target, horizon in [(0.02, 0.05, 500), (0.2, 0.3, 12345)]:
        updates = [[float(torch.rand(1, generator=gen)) * 0.5, int(torch.randint(1, 300, (1,), generator=gen))] for _ in range(15)]
        for kind in ("fixed", "adaptive"):
            ctl = ca.FixedKLController(coef) if kind == "fixed" else ca.AdaptiveKLController(coef, target, horizon)
            values = []
            for kl, n in updates:
                ctl.update(kl, n)
                values.append(float(ctl.value))
            add("kl_controller", kind, {"kl_coef": coef, "target_kl": target, "horizon": horizon}, {"updates": updates},
                {"values": values})

    def compact(value):
        # 12 significant digits: far below the 1e-6 tolerance, a third of the file size
        if isinstance(value, float):
            return float(f"{value:.12g}")
        if isinstance(value, list):
            return [compact(v) for v in value]
        if isinstance(value, dict):
            return {k: compact(v) for k, v in value.items()}
        return value

    cases = compact(cases)
    with open(out, "w") as f:
        json.dump({"source": "verl-project/verl core_algos + rollout_corr_helper (reference implementation)",
                   "seed": 7, "cases": cases}, f, separators=(",", ":"))
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
