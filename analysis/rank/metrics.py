"""Pure rank measures of attention matrices and token representations (NumPy), compared against formulas in
tests/test_rank.py.

  numerical_rank     singular values above a tolerance. Default tolerance = NumPy's matrix_rank default,
                     S.max() * max(M, N) * eps(dtype); `rtol` gives rtol * S.max() instead.
  effective_rank     exp(entropy of the normalized singular values p_i = s_i / sum s) (Roy & Vetterli 2007):
                     n for an orthogonal matrix, 1 for rank one.
  triangular_logdet  log|det| = sum log|diag| of a triangular matrix (NaN if not triangular); a causal attention
                     matrix is lower-triangular with a positive diagonal, so it is finite (full rank).
  residual_ratio     rank collapse of token representations X [n, D]: ||X - 1 mean(X)^T|| / ||X||, in the composite
                     l1/linf norm of Dong et al. 2021, ||A||_{1,inf} = sqrt(||A||_1 ||A||_inf), or Frobenius.
                     0 means every token has the same representation (rank one).
"""

import numpy as np


def singular_values(A_NxMxK):
    """Singular values, descending, of one matrix [M, K] or a stack [..., M, K]; computed in float64."""
    return np.linalg.svd(np.asarray(A_NxMxK, np.float64), compute_uv=False)


def default_tolerance(s, shape, dtype=np.float32):
    """NumPy's matrix_rank tolerance S.max() * max(M, N) * eps, with eps of the dtype the matrix was computed
    in (float32 for the model's softmax), per matrix of a stack."""
    return np.max(s, axis=-1) * max(shape[-2:]) * np.finfo(dtype).eps


def numerical_rank(A, rtol=None, dtype=np.float32):
    """Rank of A [..., M, K]: singular values > tol; tol = default_tolerance, or rtol * S.max() when given."""
    s = singular_values(A)
    tol = default_tolerance(s, np.shape(A), dtype) if rtol is None else rtol * np.max(s, axis=-1)
    return np.sum(s > np.asarray(tol)[..., None], axis=-1)


def effective_rank(A=None, s=None):
    """exp(H(p)), p = s / sum(s), of A [..., M, K] (or of given singular values s); 0 log 0 = 0."""
    s = singular_values(A) if s is None else np.asarray(s, np.float64)
    p = s / np.maximum(np.sum(s, axis=-1, keepdims=True), np.finfo(np.float64).tiny)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)
    return np.exp(h)


def is_triangular(A):
    """(lower, upper): whether every matrix of A [..., n, n] is exactly lower / upper triangular."""
    A = np.asarray(A)
    n = A.shape[-1]
    lower = np.all(np.where(np.triu(np.ones((n, n), bool), 1), A == 0, True), axis=(-2, -1))
    upper = np.all(np.where(np.tril(np.ones((n, n), bool), -1), A == 0, True), axis=(-2, -1))
    return lower, upper


def triangular_logdet(A):
    """log|det A| = sum_i log|A_ii| for triangular A [..., n, n]; NaN where A is neither lower nor upper
    triangular; -inf where a diagonal entry is 0 (singular)."""
    A = np.asarray(A, np.float64)
    lower, upper = is_triangular(A)
    with np.errstate(divide="ignore"):
        logdet = np.sum(np.log(np.abs(np.diagonal(A, axis1=-2, axis2=-1))), axis=-1)
    return np.where(lower | upper, logdet, np.nan)


def block_triangular_logdet(A, P: int):
    """log|det A| for A [..., n, n] with A[:P, P:] = 0 (prefix rows never see the output part), as
    logdet(A[:P,:P]) + logdet(A[P:,P:]) when both diagonal blocks are triangular (NaN otherwise). This covers the
    causal matrix and the mixed mask's upper-triangular heads, whose whole matrix is not triangular."""
    A = np.asarray(A, np.float64)
    if P <= 0 or P >= A.shape[-1]:
        return triangular_logdet(A)
    zero_block = np.all(A[..., :P, P:] == 0, axis=(-2, -1))
    out = triangular_logdet(A[..., :P, :P]) + triangular_logdet(A[..., P:, P:])
    return np.where(zero_block, out, np.nan)


def composite_norm(A):
    """||A||_{1,inf} = sqrt(||A||_1 ||A||_inf): max column abs sum times max row abs sum (Dong et al. 2021)."""
    a = np.abs(np.asarray(A, np.float64))
    return np.sqrt(a.sum(-2).max(-1) * a.sum(-1).max(-1))


def residual_ratio(X_NxD, norm: str = "l1linf"):
    """||X - 1 mean(X)^T|| / ||X|| for token representations X [..., n, D] (mean over the n tokens)."""
    X = np.asarray(X_NxD, np.float64)
    R = X - X.mean(-2, keepdims=True)
    if norm == "l1linf":
        num, den = composite_norm(R), composite_norm(X)
    elif norm == "fro":
        num, den = np.linalg.norm(R, axis=(-2, -1)), np.linalg.norm(X, axis=(-2, -1))
    else:
        raise ValueError(f"unknown norm {norm!r}; use 'l1linf' or 'fro'")
    return num / np.maximum(den, np.finfo(np.float64).tiny)
