"""`kimi-mlx server`: an OpenAI- and Anthropic-compatible HTTP API (FastAPI + uvicorn) and a
chat page at /.

Modules, one job each (every module of this folder):
  cli.py          `kimi-mlx server` flags; loads the model and runs uvicorn
  serving.py      what `kimi-mlx server` and `kimi-mlx cluster server` share: the server
                  flags and their checks, the service (model, engine, caches), the uvicorn loop
  app.py          the FastAPI app: routes, auth, errors, body limit, health and metrics
  openapi.py      the OpenAPI document, with the request models the routes read themselves
  metrics.py      Prometheus metrics, one registry per app
  common.py       what the API modules share: the served model (`Service`), API errors, a
                  `Job` from checked parameters, token events -> reply events
  body_json.py    request bodies parsed in pieces, their nesting read from the bytes,
                  so a multi-MB body does not stall the other clients' streams
  schemas.py      pydantic request models of the APIs
  openai_api.py, anthropic_api.py, responses_api.py   request -> prompt, reply events ->
                  response shapes (chat / completions, messages, responses)
  ollama_api.py   the Ollama API (/api/* and /ollama/api/*): each request becomes the chat
                  route's request, replies in Ollama's NDJSON / JSON shapes
  structured.py   response_format / tool_choice -> the grammar a request's sampling enforces
  thinking.py     thinking budgets (a request's, --thinking-budget) as a forced end of thinking
  images.py       image parts of requests: data URLs / base64 (URLs with --allow-image-urls),
                  limits, 400s naming the image, the prompt-cache key of a prompt with images
  reply.py        token ids -> text (UTF-8 safe), stop strings, reasoning / content / tool calls
  scoring.py      log-probabilities of a prompt's own tokens (/v1/completions echo + logprobs)
  jobs.py         a request (`Job`), its events, queue admission (`Busy`) and the MLX worker
                  thread wrapper, shared by every engine
  engine_base.py  the engine contract every deployment serves through (`BaseEngine`)
  models.py       which checkpoint the one-process server holds: load, idle unload
                  (--idle-unload, keep_alive), reload, swap by request; requests' leases
  catalog.py      the models a server may serve (--model NAME=PATH, --models-dir,
                  --allow-models), keep_alive durations, the /v1/models listing
  engine.py       the one-process engine: a worker thread running mlx-lm's generate loop,
                  streaming token events to the requests waiting on them
  batch.py        continuous batching for that engine (mlx-lm's `BatchGenerator`)
  prompt_cache.py snapshots of the model cache across requests (memory LRU)
  disk_cache.py   the prompt cache's disk tier (--prompt-cache-dir)
  web/            the chat page (static HTML/JS/CSS; vendored marked, DOMPurify, highlight.js)
"""
