"""An unmodified OpenAI SDK client, made adapter-aware with wrap_openai, against the embedded engine.

    python examples/wrap_openai_client.py
"""

import openai

import acelora
from acelora.serving import BackgroundServer
from acelora_kernels import Engine, create_app, demo_assets
from acelora_kernels.tiny import TINY_MODEL_NAME, load_model_and_tokenizer

assets = demo_assets(5)  # tiny Llama + five trained demo adapters (cached after the first run)
model, tokenizer = load_model_and_tokenizer(assets.base_dir)
engine = Engine(model, tokenizer, adapters=assets.adapters)  # static adapters, like vLLM's --lora-modules

with BackgroundServer(create_app(engine, TINY_MODEL_NAME)) as upstream:
    skill = acelora.MultiLoRA(
        registry=acelora.AdapterRegistry.from_dir(assets.adapters_dir, tenants={"tenant_dev_01": ["code-python-v2"]}),
        mode="prod",
        base_model=TINY_MODEL_NAME,
    )
    client = acelora.wrap_openai(openai.OpenAI(base_url=upstream.url + "/v1", api_key="none"), skill,
                                 tenant="tenant_dev_01")
    for adapter in ["code-python-v2", "med-qa-v1", "no-such-adapter"]:
        raw = client.chat.completions.with_raw_response.create(
            model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "Sum a list in Python."}],
            max_tokens=24, temperature=0, extra_body={"lora_name": adapter},
        )
        reply = raw.parse()
        print(f"{adapter:16} -> model={reply.model!r:20} {reply.choices[0].message.content!r}")
        print(f"{'':16}    {raw.headers['x-ace-trace-multi-lora']}")
    print("actions:", [e.action for e in skill.traces.all()])
