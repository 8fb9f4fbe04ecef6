"""An OpenAI-compatible HTTP server over a pipeline (``tokenswift serve``; needs the
``serve`` extra: Starlette and uvicorn). See :mod:`tokenswift.server.app`."""
