"""`kimi-mlx server`: an OpenAI- and Anthropic-compatible HTTP API (FastAPI + uvicorn).

Modules, one job each:
  engine.py   runs generation on a worker thread (mlx-lm's generate loop / BatchGenerator)
              and streams token events to the requests waiting on them
  reply.py    token ids -> text (UTF-8 safe), stop strings, reasoning / content / tool calls
  schemas.py  pydantic request models of the three APIs
  openai_api.py, anthropic_api.py   request -> prompt, reply events -> response shapes
  app.py      the FastAPI app: routes, auth, errors, health, metrics
  cli.py      `kimi-mlx server` flags; loads the model and runs uvicorn
"""
