//! Bounds of the HTTP server whatever a client sends: request bodies have a size limit,
//! a read deadline and a shared memory budget (a bound on concurrent large bodies), and
//! no answer ever echoes the body back (a parse error names the problem and where).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The server's limits (every knob is in `docs/scheduler-extender.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Largest request body accepted, bytes.
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once, over all requests (being read or being
    /// answered); a request waits for room until its body deadline.
    pub body_memory_bytes: usize,
    /// Deadline to receive a request's headers, from the connection's first byte or
    /// the end of its previous request.
    pub header_timeout: Duration,
    /// Deadline to receive a request's whole body (and room for it in the budget),
    /// from the end of its headers.
    pub body_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_body_bytes: 64 << 20,
            body_memory_bytes: 256 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// Why limits are inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// A limit of 0.
    #[error("{name} must be more than 0")]
    Zero {
        /// The option.
        name: &'static str,
    },
    /// The memory budget could never hold one body of the largest size.
    #[error(
        "body memory budget {budget} bytes is smaller than the largest body accepted ({max} bytes)"
    )]
    BudgetBelowBody {
        /// `body_memory_bytes`.
        budget: usize,
        /// `max_body_bytes`.
        max: usize,
    },
}

/// Bytes per permit of the budget's semaphore.
const UNIT: usize = 1024;

impl HttpLimits {
    /// Checks the limits: none is 0 and the budget holds at least one largest body.
    pub fn check(&self) -> Result<(), LimitsError> {
        for (name, zero) in [
            ("max body size", self.max_body_bytes == 0),
            ("body memory budget", self.body_memory_bytes == 0),
            ("header timeout", self.header_timeout.is_zero()),
            ("body timeout", self.body_timeout.is_zero()),
        ] {
            if zero {
                return Err(LimitsError::Zero { name });
            }
        }
        if self.body_memory_bytes < self.max_body_bytes {
            return Err(LimitsError::BudgetBelowBody {
                budget: self.body_memory_bytes,
                max: self.max_body_bytes,
            });
        }
        Ok(())
    }
}

/// The shared budget of request-body memory.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    limits: HttpLimits,
    permits: Arc<Semaphore>,
}

/// A request body read in full, holding its share of the budget until dropped.
#[derive(Debug)]
pub struct HeldBody {
    /// The bytes.
    pub bytes: Bytes,
    _permit: OwnedSemaphorePermit,
}

/// Why a request body was not read; answered with a status and this message, which
/// never contains the body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Larger than the limit (declared in `Content-Length` or received).
    #[error("request body too large: {size} bytes, the limit is {limit} bytes (--max-body-mib)")]
    TooLarge {
        /// The size declared or received so far.
        size: u64,
        /// The limit.
        limit: usize,
    },
    /// Not received in full within the deadline.
    #[error(
        "request body not received within {timeout:?} ({received} of {expected} bytes received)"
    )]
    Timeout {
        /// The deadline.
        timeout: Duration,
        /// Bytes received.
        received: usize,
        /// Bytes declared, or "unknown".
        expected: String,
    },
    /// No room in the body memory budget within the deadline.
    #[error(
        "server busy: {budget} bytes of request bodies already in flight, no room for {size} more within {timeout:?}"
    )]
    Busy {
        /// The budget.
        budget: usize,
        /// Bytes this request needed.
        size: usize,
        /// The deadline.
        timeout: Duration,
    },
    /// The connection failed while the body was read.
    #[error("request body could not be read: {0}")]
    Read(String),
}

impl BodyError {
    /// The HTTP status of the answer.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BodyError::Read(_) => StatusCode::BAD_REQUEST,
        }
    }
}

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl BodyBudget {
    /// A budget for `limits` (checked with [`HttpLimits::check`]).
    #[must_use]
    pub fn new(limits: HttpLimits) -> Self {
        let total = limits
            .body_memory_bytes
            .div_ceil(UNIT)
            .min(Semaphore::MAX_PERMITS);
        BodyBudget {
            limits,
            permits: Arc::new(Semaphore::new(total)),
        }
    }

    /// The limits.
    #[must_use]
    pub fn limits(&self) -> HttpLimits {
        self.limits
    }

    /// Reads a body within the size limit, the deadline and the budget.
    pub async fn read(&self, headers: &HeaderMap, body: Body) -> Result<HeldBody, BodyError> {
        let limit = self.limits.max_body_bytes;
        let timeout = self.limits.body_timeout;
        let deadline = Instant::now() + timeout;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(size) = declared
            && size > limit as u64
        {
            return Err(BodyError::TooLarge { size, limit });
        }
        let busy = |size: usize| BodyError::Busy {
            budget: self.limits.body_memory_bytes,
            size,
            timeout,
        };
        // A declared body takes its room before a byte is read; an undeclared one
        // takes it as it arrives.
        let first = declared.map_or(0, |d| usize::try_from(d).unwrap_or(limit));
        let mut permit = tokio::time::timeout_at(
            deadline,
            self.permits.clone().acquire_many_owned(units(first)),
        )
        .await
        .map_err(|_| busy(first))?
        .map_err(|_| busy(first))?;
        let mut held = first.div_ceil(UNIT) * UNIT;
        let mut buf = Vec::with_capacity(first);
        let mut body = body;
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    return Err(BodyError::Timeout {
                        timeout,
                        received: buf.len(),
                        expected: declared.map_or_else(|| "unknown".into(), |d| d.to_string()),
                    });
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(BodyError::Read(e.to_string())),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            let size = buf.len() + data.len();
            if size > limit {
                return Err(BodyError::TooLarge {
                    size: size as u64,
                    limit,
                });
            }
            if size > held {
                let more = size - held;
                let extra = tokio::time::timeout_at(
                    deadline,
                    self.permits.clone().acquire_many_owned(units(more)),
                )
                .await
                .map_err(|_| busy(size))?
                .map_err(|_| busy(size))?;
                held += more.div_ceil(UNIT) * UNIT;
                permit.merge(extra);
            }
            buf.extend_from_slice(&data);
        }
        Ok(HeldBody {
            bytes: Bytes::from(buf),
            _permit: permit,
        })
    }
}

/// Longest text of a JSON parse error kept in an answer.
const MAX_PARSE_MESSAGE: usize = 240;
/// Longest quoted value kept from a JSON parse error.
const MAX_QUOTED: usize = 32;

/// A JSON parse error in words that never reproduce more than a few bytes of the input:
/// serde's message (which quotes offending values: a string of any length) with every
/// quoted value cut to 32 characters, at most 240 bytes,
/// then the position.
#[must_use]
pub fn describe_json_error(e: &serde_json::Error) -> String {
    let raw = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let message = raw.strip_suffix(&position).unwrap_or(&raw);
    let mut out = String::with_capacity(MAX_PARSE_MESSAGE + position.len() + 8);
    let mut quoted: Option<(char, usize)> = None;
    for c in message.chars() {
        if out.len() >= MAX_PARSE_MESSAGE {
            out.push('…');
            break;
        }
        match quoted {
            Some((q, _)) if c == q => {
                quoted = None;
                out.push(c);
            }
            Some((q, n)) => {
                if n < MAX_QUOTED {
                    out.push(c);
                } else if n == MAX_QUOTED {
                    out.push('…');
                }
                quoted = Some((q, n + 1));
            }
            None => {
                if c == '"' || c == '`' {
                    quoted = Some((c, 0));
                }
                out.push(c);
            }
        }
    }
    if e.line() != 0 {
        out.push_str(&position);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    #[test]
    fn json_errors_never_echo_long_values() {
        let huge = format!("{{\"Pod\": \"{}\"}}", "A".repeat(1 << 20));
        let e = serde_json::from_str::<std::collections::BTreeMap<String, u32>>(&huge)
            .expect_err("not a number");
        let text = describe_json_error(&e);
        assert!(text.len() < 400, "{} bytes", text.len());
        assert!(
            text.contains("invalid type") && text.contains("line 1"),
            "{text}"
        );
        let e =
            serde_json::from_str::<std::collections::BTreeMap<String, u32>>("{").expect_err("eof");
        assert!(
            describe_json_error(&e).contains("EOF"),
            "{}",
            describe_json_error(&e)
        );
    }

    fn limits() -> HttpLimits {
        HttpLimits {
            max_body_bytes: 4096,
            body_memory_bytes: 8192,
            header_timeout: Duration::from_millis(100),
            body_timeout: Duration::from_millis(200),
        }
    }

    fn declared(n: usize) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, n.into());
        h
    }

    #[tokio::test]
    async fn a_full_budget_refuses_at_the_deadline() {
        let budget = BodyBudget::new(limits());
        let a = budget
            .read(&declared(4096), Body::from(vec![b'x'; 4096]))
            .await;
        let b = budget
            .read(&declared(4096), Body::from(vec![b'x'; 4096]))
            .await;
        assert_eq!(a.as_ref().map(|h| h.bytes.len()), Ok(4096));
        assert_eq!(b.as_ref().map(|h| h.bytes.len()), Ok(4096));
        // Both held: the third finds no room within its deadline.
        let start = std::time::Instant::now();
        let e = budget
            .read(&declared(10), Body::from(vec![b'x'; 10]))
            .await
            .unwrap_err();
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.to_string().contains("8192 bytes"), "{e}");
        // One released: room again; an undeclared body is charged as it arrives.
        drop(a);
        let c = budget
            .read(&HeaderMap::new(), Body::from(vec![b'y'; 3000]))
            .await;
        assert_eq!(c.map(|h| h.bytes.len()), Ok(3000));
        // Too large, declared or not.
        let e = budget
            .read(&declared(5000), Body::from(vec![b'x'; 5000]))
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let e = budget
            .read(&HeaderMap::new(), Body::from(vec![b'x'; 5000]))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("5000 bytes") && e.to_string().contains("4096"),
            "{e}"
        );
    }

    #[test]
    fn limits_are_checked() {
        assert_eq!(HttpLimits::default().check(), Ok(()));
        let l = HttpLimits {
            body_memory_bytes: 1 << 20,
            ..HttpLimits::default()
        };
        assert!(matches!(
            l.check(),
            Err(LimitsError::BudgetBelowBody { .. })
        ));
        let l = HttpLimits {
            body_timeout: Duration::ZERO,
            ..HttpLimits::default()
        };
        assert!(l.check().unwrap_err().to_string().contains("body timeout"));
    }
}
