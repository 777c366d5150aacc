"""llama-server's router mode: bloomery-serve started with no model serves several on demand.

    catalog.py   which models there are (--models-dir, the download cache): names -> sources
    table.py     the bookkeeping (status, port, last use, requests in flight, the --models-max cap, LRU victim)
    children.py  one child bloomery-serve per loaded model, on a free local port; start, health, stop
    pool.py      every load and unload (the one owner of them) and the waits of the requests on them
    proxy.py     one request forwarded to a child over HTTP/1.1, streams passed through chunk by chunk
    routes.py    the router's own routes (/models, /models/load, /models/unload, /props, /health) and the
                 dispatch of every other route by its "model" (body or query)
    serve.py     the supervisor's router run: the HTTP front with the Gate, the Router behind it
"""
