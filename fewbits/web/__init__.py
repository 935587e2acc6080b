"""`fewbits ui`: the decode explorer, the quantiser playground and the results pages, and their JSON API.

The pages (HTML/JS/CSS under static/, Chart.js vendored from npm) draw and print what the API returns;
the API's numbers come from the same library functions the command line prints (`fewbits.cost.report`,
`fewbits.eval.playground`, `fewbits.eval.layer_error`).  `fewbits.web.app` needs the `ui` extra
(FastAPI, uvicorn); `fewbits.web.service` needs only the cost model.
"""
