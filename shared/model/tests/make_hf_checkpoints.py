"""Reference checkpoints for jetrl-model's tests, made with HF transformers (no network).

    python make_hf_checkpoints.py build OUT_DIR
        Writes tiny random checkpoints, one folder each, in the layouts jetrl must read:
          qwen2_tied, qwen2_untied, qwen2_bf16 (weights stored as bf16), qwen2_sharded (index + shards),
          qwen2_old_layout (rope_theta at the top of config.json, chat template inside tokenizer_config.json),
          llama (biases, llama3 RoPE scaling inside rope_parameters), llama_old_layout (rope_theta and
          rope_scaling at the top), qwen3 (q/k norm, explicit head_dim, template list in tokenizer_config.json),
          qwen2_moe (routed experts, a gated shared expert, qkv_bias) and qwen3_moe (routed experts renormalised
          over the top k, one dense layer by mlp_only_layers).
        Each folder gets reference.json: {"sequences", "logprobs" (f32, by transformers), "chat": [{"messages",
        "tools"?, "add_generation_prompt", "ids"}]}; the MoE ones also "aux_loss" (transformers' load-balancing
        loss of each sequence's forward).

    python make_hf_checkpoints.py score MODEL_DIR
        Loads MODEL_DIR with AutoModelForCausalLM + AutoTokenizer and prints the same reference JSON for a fixed
        set of conversations and texts (used to check jetrl's `init_model` output).

The tokenizer is the hf-sample one (tests/golden/hf-sample/llama/tokenizer.json).
"""

import json
import os
import shutil
import sys

import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE_TOKENIZER = os.path.join(HERE, "..", "..", "..", "tests", "golden", "hf-sample", "llama", "tokenizer.json")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are terse." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, \"now\" or <later>.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = [
    ([{"role": "user", "content": "What is 7 times 6?"}], None),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Add 12 and 30."},
            {"role": "assistant", "content": "#### 42"},
            {"role": "user", "content": "  Again?  "},
        ],
        None,
    ),
]

TOOL_CONVERSATIONS = [
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "<think>\nneed a tool\n</think>\n\nLet me check.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "<think>easy</think>It is 21 C."},
        ],
        TOOLS,
    ),
]


def make_tokenizer(bos=None):
    tok = PreTrainedTokenizerFast(
        tokenizer_file=SAMPLE_TOKENIZER, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=bos
    )
    return tok


def perturb(model, seed):
    """Random init at a scale that makes the log-probs far from uniform, with norm weights and biases off their
    defaults so a loader that skipped them would be caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def sequences(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (2, 9, 33, 80, 150)]


def reference(model, tok, seqs, convs, tokenizer_json=None):
    """Log-probs by transformers; chat ids as the golden README defines them: the template rendered by
    transformers, tokenized by tokenizer.json without special tokens. (transformers 5's own tokenize=True can
    differ: for model_type qwen2 it swaps in Qwen2Tokenizer, which rebuilds Qwen's pre-tokenizer in code
    regardless of tokenizer.json; `hf_ids` records what it gives.)"""
    model.eval()
    logprobs = []
    aux_losses = []
    moe = getattr(model.config, "num_experts", 0) > 0
    with torch.no_grad():
        for ids in seqs:
            out = model(torch.tensor([ids]), output_router_logits=moe)
            logits = out.logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            logprobs.append(lp.tolist())
            if moe:
                aux_losses.append(float(out.aux_loss))
    chat = []
    raw = Tokenizer.from_file(tokenizer_json) if tokenizer_json else None
    for messages, tools in convs:
        for agp in (True, False):
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False)
            hf_ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=True)["input_ids"]
            ids = raw.encode(text, add_special_tokens=False).ids if raw else hf_ids
            item = {"messages": messages, "add_generation_prompt": agp, "ids": list(ids), "hf_ids": list(hf_ids)}
            if tools is not None:
                item["tools"] = tools
            chat.append(item)
    ref = {"sequences": seqs, "logprobs": logprobs, "chat": chat}
    if aux_losses:
        ref["aux_loss"] = aux_losses
    return ref


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)


def edit_json(path, fn):
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    write_json(path, obj)


def build_one(out, name, config_cls, model_cls, config_kwargs, template, convs, seed, bos=None, max_shard_size=None,
              save_dtype=None, edit=None):
    """Saves a random model with transformers, lets `edit` rewrite files into another layout, then computes the
    reference from what is on disk, read back as transformers reads it."""
    path = os.path.join(out, name)
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(seed)
    config = config_cls(**config_kwargs)
    model = model_cls(config)
    perturb(model, seed)
    if save_dtype is not None:
        model = model.to(save_dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tok = make_tokenizer(bos)
    tok.chat_template = template
    tok.save_pretrained(path)
    if edit is not None:
        edit(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ref = reference(model, tok, sequences(config.vocab_size, seed), convs, os.path.join(path, "tokenizer.json"))
    ref["model"] = name
    write_json(os.path.join(path, "reference.json"), ref)
    return path


def template_into_tokenizer_config(path, as_list=False):
    jinja = os.path.join(path, "chat_template.jinja")
    with open(jinja) as f:
        template = f.read()
    os.remove(jinja)

    def put(cfg):
        # HF picks `tool_use` when tools are passed, `default` otherwise.
        tool_use = "{{- 'tool-use template: ' }}" + template
        cfg["chat_template"] = (
            [{"name": "default", "template": template}, {"name": "tool_use", "template": tool_use}]
            if as_list
            else template
        )

    edit_json(os.path.join(path, "tokenizer_config.json"), put)


def build(out):
    os.makedirs(out, exist_ok=True)
    small = dict(
        vocab_size=400, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    qwen2 = dict(small, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    build_one(out, "qwen2_tied", Qwen2Config, Qwen2ForCausalLM, dict(qwen2, tie_word_embeddings=True), CHATML,
              CONVERSATIONS, 1)
    build_one(out, "qwen2_untied", Qwen2Config, Qwen2ForCausalLM, dict(qwen2, tie_word_embeddings=False), CHATML,
              CONVERSATIONS, 2)
    build_one(out, "qwen2_bf16", Qwen2Config, Qwen2ForCausalLM, dict(qwen2, tie_word_embeddings=False), CHATML,
              CONVERSATIONS, 3, save_dtype=torch.bfloat16)
    path = build_one(out, "qwen2_sharded", Qwen2Config, Qwen2ForCausalLM, dict(qwen2, tie_word_embeddings=False),
                     CHATML, CONVERSATIONS, 4, max_shard_size="60KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")), "sharding did not happen"

    def old_layout(path):
        def old_rope(cfg):
            cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
            cfg["rope_scaling"] = None
            cfg["torch_dtype"] = cfg.pop("dtype", "float32")

        edit_json(os.path.join(path, "config.json"), old_rope)
        template_into_tokenizer_config(path)

    build_one(out, "qwen2_old_layout", Qwen2Config, Qwen2ForCausalLM,
              dict(small, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=True),
              QWEN25_TEMPLATE, CONVERSATIONS + TOOL_CONVERSATIONS, 5, edit=old_layout)

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama = dict(small, head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                 rope_parameters=llama3)
    build_one(out, "llama", LlamaConfig, LlamaForCausalLM, llama, LLAMA3_TEMPLATE, CONVERSATIONS, 6,
              bos="<|endoftext|>")

    def old_llama_rope(path):
        def edit(cfg):
            params = cfg.pop("rope_parameters")
            cfg["rope_theta"] = params.pop("rope_theta")
            cfg["rope_scaling"] = params

        edit_json(os.path.join(path, "config.json"), edit)

    build_one(out, "llama_old_layout", LlamaConfig, LlamaForCausalLM, llama, LLAMA3_TEMPLATE, CONVERSATIONS, 7,
              bos="<|endoftext|>", edit=old_llama_rope)

    qwen3 = dict(small, head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    build_one(out, "qwen3", Qwen3Config, Qwen3ForCausalLM, qwen3, QWEN3_TEMPLATE, CONVERSATIONS + TOOL_CONVERSATIONS, 8,
              edit=lambda path: template_into_tokenizer_config(path, as_list=True))

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.01)
    qwen2_moe = dict(qwen2, **moe, shared_expert_intermediate_size=48, tie_word_embeddings=False)
    build_one(out, "qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, qwen2_moe, CHATML, CONVERSATIONS, 9)
    qwen3_moe = dict(qwen3, **moe, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
    build_one(out, "qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, qwen3_moe, QWEN3_TEMPLATE, CONVERSATIONS, 10)


def score(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = CONVERSATIONS + [([{"role": "user", "content": "Compute (3+4)*2 = ?"}, {"role": "assistant", "content": "#### 14"}], None)]
    ref = reference(model, tok, [], convs, os.path.join(model_dir, "tokenizer.json"))
    texts = ["12+30=42", "What is 7 times 6?\nanswer: 42."]
    ref["texts"] = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    seqs = [item["ids"] for item in ref["chat"]] + [t["ids"] for t in ref["texts"]]
    ref["sequences"] = seqs
    ref["logprobs"] = reference(model, tok, seqs, [])["logprobs"]
    ref["eos_token_id"] = model.generation_config.eos_token_id
    ref["decoded"] = tok.decode(ref["texts"][1]["ids"])
    print(json.dumps(ref, ensure_ascii=False))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("build", "score"):
        sys.exit(__doc__)
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        score(sys.argv[2])
