"""HTTP server over a live memory (``elasticmem.live.LiveMemory``): tenants add turns and ask questions.

The package: ``settings`` (limits, batching), ``auth`` (API keys), ``worker`` (the model worker and
its per-tenant queues), ``quota`` (memory quotas), ``asgi`` (metrics and the gate before the
routes), ``app`` (``create_app``), ``cli`` (``main``).

    pip install 'elasticmem[serve]'
    elasticmem-serve --checkpoint runs/train/quickstart/final --bank runs/bank/live \\
        --api-keys keys.json [--port 8000] [key=value ...]      # or: python -m elasticmem.serve ...

One process holds one model. Every piece of model work (asks and adds) goes through ONE worker
thread: requests that arrive within a short collection window (``--batch-window-ms``, default 5)
are answered by one batched forward (``LiveMemory.ask_many``, at most ``--max-batch`` requests,
default 8; ``--no-batching`` answers one at a time), and adds are applied in arrival order, the
sessions of one batch in one append (``LiveMemory.add_many``, one disk write), before its asks.
An add is answered only once it is on disk, so any request sent after its response sees it.
Trailing ``key=value`` arguments are config overrides (``backbone.device=cpu memory.top_z=4``), as
for ``evaluate.py``.

Tenants (``--api-keys FILE``, JSON, or YAML when the name ends in .yaml/.yml)::

    {"sk-a-...": {"tenant": "a", "groups": ["tenantA/*", "shared-notes"]},
     "sk-b-...": {"tenant": "b", "groups": ["tenantB/*"]}}

Each key names the memory groups it may read and write (``fnmatch`` patterns, case-sensitive). Every
request sends ``Authorization: Bearer KEY``: no or an unknown key is 401, a group the key does not
cover is 403 (also for listing, so a tenant cannot even learn whether another tenant's group
exists). A request names exactly one group and the model searches only that group's memories, so an
answer can neither retrieve nor inject another group's memory; the server also refuses (500) any
answer whose memories name another group. Without ``--api-keys`` the server is open to anyone who
can reach it (a warning is logged): keep it on 127.0.0.1 then.

Endpoints (``$K`` = an API key; errors are ``{"error": {"message", "type", "code"}}``):

``POST /v1/memory/{group}`` adds one session of turns to a group (created on first use); the turns
are chunked like the data pipeline (a user turn and the assistant turn after it make one chunk).
Returns ``{"group", "added", "skipped", "rows"}``; a chunk whose text the group already holds is
skipped, so a retried request adds nothing::

    curl -s localhost:8000/v1/memory/tenantA/notes -H "Authorization: Bearer $K" \\
        -H 'Content-Type: application/json' \\
        -d '{"turns": [{"role": "user", "content": "My cat is called Miso."},
                       {"role": "assistant", "content": "Noted: Miso."}]}'

``GET /v1/memory/{group}`` lists the group's chunks ``{"group", "chunks": [{"row", "group", "text",
"session", "turns", "n_tokens"}, ...]}`` (an empty list for a group with no memory)::

    curl -s localhost:8000/v1/memory/tenantA/notes -H "Authorization: Bearer $K"

``DELETE /v1/memory/{group}`` forgets the whole group, ``?session=N`` one session, ``?row=R`` one
memory (its ``row`` in the listing): ``{"group", "deleted", "rows", "purged"}``, answered once the
memories are out of search and out of the bank's files (``LiveMemory.forget``). Memories not in the
group are 404 (a retried delete too); the key must cover the group (403), as for every route::

    curl -s -X DELETE "localhost:8000/v1/memory/tenantA/notes?row=17" -H "Authorization: Bearer $K"

``POST /v1/ask`` answers a question from one group's memory (greedy decoding): ``{"group",
"question", "choices"?: [str], "max_new_tokens"?: int}`` -> ``{"group", "question", "text",
"memories": [{"rank", "row", "group", "score", "budget", "tokens", "text"}], "prompt_tokens",
"memory_tokens", "generated_tokens", "total_tokens", "latency": {stage: seconds}}``::

    curl -s localhost:8000/v1/ask -H "Authorization: Bearer $K" -H 'Content-Type: application/json' \\
        -d '{"group": "tenantA/notes", "question": "What is my cat called?"}'

``POST /v1/chat/completions`` is the same in OpenAI's chat-completion format. The memory group is the
top-level ``memory_group`` field (else ``user``); the question is the last user message (earlier
messages are not read: the memory is the history). Sampling parameters are accepted and ignored
(decoding is greedy); ``max_tokens`` / ``max_completion_tokens`` bound the answer; ``stream`` and
``n > 1`` are refused (400). ``usage.prompt_tokens`` counts the memory tokens (also given apart as
``usage.memory_tokens``); the response adds ``memories`` (as in ``/v1/ask``) and ``memory_group``::

    curl -s localhost:8000/v1/chat/completions -H "Authorization: Bearer $K" \\
        -H 'Content-Type: application/json' \\
        -d '{"model": "elasticmem", "memory_group": "tenantA/notes",
             "messages": [{"role": "user", "content": "What is my cat called?"}]}'

``GET /v1/models`` lists the one model (OpenAI format), for clients that ask first::

    curl -s localhost:8000/v1/models -H "Authorization: Bearer $K"

``GET /health`` (no key needed; no tenant data) says whether the worker runs::

    curl -s localhost:8000/health

``GET /metrics`` (no key needed; counts only, no group names): requests by endpoint and status,
latency p50/p95 of successful requests per endpoint (the last 10,000), batches run, mean and
largest ask batch, asks answered, sessions and chunks added, memories forgotten, queue depth, worker
time::

    curl -s localhost:8000/metrics

``GET /openapi.json`` and ``GET /docs`` describe the API; they need a key like the API does, unless
``--open-docs``.

Tenants are served in turn: each tenant has its own queue and the worker takes one request of each
tenant with requests waiting, so a tenant that floods the server waits behind its own requests. A
client that disconnects while its request waits for the model has it dropped from the queue (never
computed); one that leaves while it is computed has its answer discarded. /metrics records both
under status 499 (nothing is sent) and counts them in ``client_gone``, not as errors.

Limits (each a field of ``Limits`` and a flag; a refusal's message names the limit, its value and
its flag; docs/serving.md explains each). The key and the tenant's requests in flight are checked
from the headers, before any of the body is read::

    limit                                                  flag                      default     status
    body size in bytes (Content-Length and while reading)  --max-body-bytes          1 MiB       413
    time to send the whole body                            --body-timeout-s          30 s        408
    turns in one add                                       --max-turns-per-request   256         413
    characters of one turn                                 --max-turn-chars          20000       413
    characters of a question / last user message           --max-question-chars      4000        422
    options of one question                                --max-choices             26          422
    characters of one option                               --max-choice-chars        1000        422
    messages of one chat completion                        --max-messages            256         422
    characters of one chat message                         --max-message-chars       20000       422
    prompt tokens after templating (before queueing)       --max-prompt-tokens       4096        413
    max_new_tokens / max_tokens                            --max-new-tokens-limit    256         422
    requests waiting for the model, all tenants            --max-queue               1024        503
    requests of one tenant waiting for the model           --tenant-max-queued       32          429 + Retry-After
    requests of one tenant in flight                       --tenant-max-in-flight    64          429 + Retry-After
    memories (bank rows) of one tenant                     --tenant-max-rows         100000      507
    bytes on disk of one tenant's memories                 --tenant-max-bytes        16 GiB      507
    open connections (uvicorn limit_concurrency)           --limit-concurrency       1024        503
    idle keep-alive seconds (uvicorn timeout_keep_alive)   --timeout-keep-alive-s    5           closed

Also: malformed JSON 400; a missing or unknown field, a group name outside ``[A-Za-z0-9._:/-]{1,128}``
or text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``) 422; shutting down 503.
Without ``--api-keys`` all clients are one tenant for the per-tenant limits.
"""

from elasticmem.serve.app import create_app
from elasticmem.serve.auth import ApiKey, AuthError, KeysFileError, authenticate, load_api_keys
from elasticmem.serve.cli import main
from elasticmem.serve.settings import GROUP_RE, INSTALL_HINT, LATENCY_WINDOW, Batching, Limits

__all__ = ["GROUP_RE", "INSTALL_HINT", "LATENCY_WINDOW", "ApiKey", "AuthError", "Batching", "KeysFileError", "Limits",
           "authenticate", "create_app", "load_api_keys", "main"]
