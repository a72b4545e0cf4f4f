"""`kimi-mlx server`: an OpenAI- and Anthropic-compatible HTTP API (FastAPI + uvicorn) and a
chat page at /.

Modules, one job each:
  engine.py   runs generation on a worker thread (mlx-lm's generate loop / BatchGenerator)
              and streams token events to the requests waiting on them
  reply.py    token ids -> text (UTF-8 safe), stop strings, reasoning / content / tool calls
  schemas.py  pydantic request models of the APIs
  openai_api.py, anthropic_api.py, responses_api.py   request -> prompt, reply events ->
              response shapes (chat / completions, messages, responses)
  images.py   image parts of requests: data URLs / base64 (URLs with --allow-image-urls),
              limits, 400s naming the image, the prompt-cache key of a prompt with images
  web/        the chat page (static HTML/JS/CSS; vendored marked, DOMPurify, highlight.js)
  app.py      the FastAPI app: routes, auth, errors, health, metrics
  cli.py      `kimi-mlx server` flags; loads the model and runs uvicorn
"""
