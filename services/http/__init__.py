"""HTTP: TGI's (and later OpenAI's) API over aiohttp, one in-memory stream per open request."""
