"""A locust file in the shape users bring from vLLM's simple API server (vllm.entrypoints.api_server):
POST /generate with a prompt and sampling fields, answer {"text": [...]}."""
import random

from locust import HttpUser, between, task

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Node:\n    def __init__(self",
           "# compute the mean of a list\n", "for i in range(10):"]


class VLLMUser(HttpUser):
    wait_time = between(0.0, 0.05)

    @task
    def generate(self):
        prompt = random.choice(PROMPTS)
        body = {"prompt": prompt, "max_tokens": random.randint(8, 32), "temperature": 0.7,
                "top_p": 0.95, "n": 1, "stream": False, "use_beam_search": False}
        with self.client.post("/generate", json=body, timeout=60, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {r.text[:200]}")
                return
            text = r.json().get("text")
            if not isinstance(text, list) or len(text) != 1 or not text[0].startswith(prompt):
                r.failure(f"unexpected answer {r.text[:200]}")
