"""Log-likelihood evaluation: eval set files (`ppl`, `ctxcont`, `pairs`), their requests and metrics
(`lmforge.eval.sets`, and `lmforge.eval.harness` for lm-evaluation-harness's conventions), scoring the requests
with the training model (`lmforge.eval.scoring`), validation in the loop (`lmforge.eval.validation`) and the eval
worker beside a run (`lmforge.eval.worker`)."""
