"""What the S3 object store raises: the port's errors for what the service or botocore said,
told apart by S3's error codes, each saying what to do and never quoting a secret."""

from __future__ import annotations

import os

from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from s3transfer.exceptions import RetriesExceededError

from services.core.errors import PermanentError, TemporaryError
from services.ports.objects.object_store import ObjectNotFoundError

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "InvalidClientTokenId",
}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
# Besides any 5xx answer. NoSuchUpload: a multipart upload that vanished (retried whole, see _upload).
_TEMPORARY = {"SlowDown", "Throttling", "RequestTimeout", "ServiceUnavailable", "InternalError", "NoSuchUpload"}


class ObjectStoreConfigError(PermanentError):
    """The store refuses the request as configured (credentials, permissions, bucket): retrying
    cannot help until the settings change. ``code``: S3's error code, or the client's error."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ObjectStoreUnavailableError(TemporaryError):
    """The store did not answer, or answered with a server error, on every attempt. ``code``:
    S3's error code, or the client's error (``ReadTimeoutError``, ``EndpointConnectionError``...)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def s3_error(
    err: Exception, *, operation: str, key: str, where: str, bucket: str, attempts: int, note: str = ""
) -> Exception:
    """The port's error for the client's ``err``, raised by ``operation`` (what was asked of which
    object, at which endpoint) on ``key`` under ``where`` (``s3://bucket/prefix``) after
    ``attempts`` attempts; ``note`` is added to what S3 said."""
    code = type(err).__name__
    if isinstance(err, ClientError):
        error = err.response.get("Error", {})
        code = str(error.get("Code", ""))
        detail = scrub(f"{code}: {error.get('Message', '')}".strip(": ")) + (f"; {note}" if note else "")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _NOT_FOUND:
            return ObjectNotFoundError(f"no object {key!r} in {where}", key)
        if code == "NoSuchBucket":
            error_class, message = (
                ObjectStoreConfigError,
                (
                    f"{operation} failed: the bucket {bucket!r} does not exist ({detail}). Create it, or point"
                    " SPOTRL_OBJECTS_URL at an existing one (and AWS_ENDPOINT_URL_S3 at its service)"
                ),
            )
        elif code in _BAD_CREDENTIALS:
            error_class, message = (
                ObjectStoreConfigError,
                (
                    f"{operation} failed: the service refused the credentials ({detail}). Check AWS_ACCESS_KEY_ID and"
                    " AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, which expires), or the pod's IAM role, and the"
                    " clock"
                ),
            )
        elif code in _DENIED:
            error_class, message = (
                ObjectStoreConfigError,
                (
                    f"{operation} failed: access denied ({detail}). Give these credentials s3:GetObject, s3:PutObject,"
                    f" s3:DeleteObject and s3:ListBucket on {where}* (without s3:ListBucket, S3 answers 403 for a"
                    " missing key)"
                ),
            )
        elif status >= 500 or code in _TEMPORARY:
            error_class, message = (
                ObjectStoreUnavailableError,
                (
                    f"{operation} failed after {attempts} attempts: {detail}. The service is failing or"
                    " throttling; this is retried later"
                ),
            )
        else:
            error_class, message = ObjectStoreConfigError, f"{operation} failed: {detail}"
    elif isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        error_class, message = (
            ObjectStoreConfigError,
            (
                f"{operation}: no usable AWS credentials ({scrub(str(err))}). Set AWS_ACCESS_KEY_ID and"
                " AWS_SECRET_ACCESS_KEY, or run with an IAM role"
            ),
        )
    elif isinstance(err, (BotoConnectionError, HTTPClientError, IncompleteReadError, RetriesExceededError)):
        error_class, message = (
            ObjectStoreUnavailableError,
            (
                f"{operation} failed after {attempts} attempts: {scrub(str(err))}. Check that the endpoint is"
                " reachable from here (AWS_ENDPOINT_URL_S3, AWS_REGION, network, proxy); this is retried later"
            ),
        )
    else:
        error_class, message = ObjectStoreConfigError, f"{operation} failed: {code}: {scrub(str(err))}"
    return error_class(message, code)


def scrub(text: str) -> str:
    """``text`` with the secret key and session token of the environment blanked, should a
    message from below ever quote one."""
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        secret = os.environ.get(name, "")
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    return text
