"""Log-likelihood evaluation: eval set files (`ppl`, `ctxcont`, `pairs`), their requests and metrics
(`lmforge.eval.sets`), and scoring the requests with the training model (`lmforge.eval.scoring`)."""
