"""MultiLoRAMiddleware inside a FastAPI service: the handler sees the decision and the rewritten body.

    python examples/fastapi_middleware.py
"""

import httpx
from fastapi import FastAPI, Request

import acelora
from acelora.serving import BackgroundServer

skill = acelora.MultiLoRA(
    registry=acelora.AdapterRegistry([acelora.AdapterSpec(name="legal-compliance-v1", path="/adapters/legal", rank=16)]),
    mode="prod",
    base_model="my-base-model",
)
app = FastAPI()
app.add_middleware(acelora.MultiLoRAMiddleware, skill=skill)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> dict:
    body = await request.json()  # already rewritten: model=<adapter>, acelora-only fields removed
    decision = request.scope["acelora.decision"]
    text = f"would run {body['model']} ({decision.action}, fallback={decision.fallback_reason})"
    return {"object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


with BackgroundServer(app) as srv:
    for lora in ["legal-compliance-v1", "legal-compliance-v9"]:
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"model": "my-base-model", "lora_name": lora, "messages": [{"role": "user", "content": "hi"}]})
        print(r.json()["choices"][0]["message"]["content"])
        print("  x-ace-trace-multi-lora:", r.headers["x-ace-trace-multi-lora"])
