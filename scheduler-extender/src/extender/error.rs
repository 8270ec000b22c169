//! The extender's errors and their one mapping to an HTTP answer.

use axum::http::StatusCode;

use super::types::{ExtenderBindingResult, ExtenderFilterResult};

/// A verb of the extender protocol (the last path segment after `urlPrefix`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// `filter`.
    Filter,
    /// `prioritize`.
    Prioritize,
    /// `bind`.
    Bind,
    /// `preempt`.
    Preempt,
}

impl Verb {
    /// The verb as written in the URL and the scheduler configuration.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
            Verb::Preempt => "preempt",
        }
    }
}

impl std::fmt::Display for Verb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an extender request could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    /// The request body is not the extender JSON this verb expects.
    #[error("parse {verb} request body: {reason}")]
    BadRequest {
        /// The verb whose body failed to parse.
        verb: Verb,
        /// What is wrong and where, never the body itself
        /// ([`super::limits::describe_json_error`]).
        reason: String,
    },
    /// The request body was refused before parsing (too large, too slow, no room).
    #[error("{verb} request")]
    Body {
        /// The verb.
        verb: Verb,
        /// Why.
        #[source]
        source: super::limits::BodyError,
    },
    /// A filter/prioritize/preempt request without a `Pod`.
    #[error("{verb} request has no Pod")]
    MissingPod {
        /// The verb.
        verb: Verb,
    },
    /// The state has not finished its first list of Nodes and Pods (just started).
    #[error(
        "cluster state not synced from the API server yet (waiting for the first list of nodes and pods)"
    )]
    NotSynced,
    /// The pod's GPU resource requests are malformed.
    #[error("read GPU request of pod {pod}: {reason}")]
    BadPodRequest {
        /// `namespace/name` of the pod.
        pod: String,
        /// What is wrong with the request.
        reason: String,
    },
    /// Bind for a pod this extender has never seen (no filter, not in the pod watch).
    #[error(
        "bind pod {pod}: pod not known to the extender (not filtered recently and not in the pod watch)"
    )]
    UnknownPod {
        /// `namespace/name` of the pod.
        pod: String,
    },
    /// Bind to a node whose GPUs the extender does not know.
    #[error("bind pod {pod} to node {node}: node not known or publishes no GPU inventory")]
    UnknownNode {
        /// `namespace/name` of the pod.
        pod: String,
        /// The node.
        node: String,
    },
    /// The pod no longer fits the node chosen by kube-scheduler (the ledger changed
    /// since filter, e.g. a concurrent bind took the GPU).
    #[error("bind pod {pod} to node {node}: no longer fits: {reason}")]
    NoLongerFits {
        /// `namespace/name` of the pod.
        pod: String,
        /// The node.
        node: String,
        /// The node's reason, as filter would give it.
        reason: String,
    },
    /// Another bind of the same pod is in flight.
    #[error("bind pod {pod}: another bind of this pod is in flight")]
    BindInFlight {
        /// `namespace/name` of the pod.
        pod: String,
    },
    /// Writing the assignment annotation on the pod failed.
    #[error("record GPU assignment on pod {pod}")]
    Annotate {
        /// `namespace/name` of the pod.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Creating the Binding failed.
    #[error("create binding of pod {pod} to node {node}")]
    Binding {
        /// `namespace/name` of the pod.
        pod: String,
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The extender was configured to answer a verb it does not serve.
    #[error("verb {verb} is not served by this extender")]
    UnsupportedVerb {
        /// The verb.
        verb: Verb,
    },
}

/// The full message of an error: its own text and every source, joined by `: `.
#[must_use]
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The one mapping from an error to the extender's HTTP answer for `verb`.
///
/// Filter and bind carry the message in their `Error` field with status 200,
/// which is how kube-scheduler expects an extender to fail (it shows the
/// message in the pod's events). Prioritize's answer (`HostPriorityList`) has
/// no error field, so its errors are status 500 with the message as the body;
/// kube-scheduler treats any non-200 as a failed call. A body that does not
/// parse is 400 for prioritize and preempt for the same reason. A body refused
/// before parsing (too large, too slow, no room) gets its own status for every verb.
#[must_use]
pub fn error_response(verb: Verb, error: &ExtenderError) -> (StatusCode, Vec<u8>) {
    let message = error_chain(error);
    if let ExtenderError::Body { source, .. } = error {
        // Refused before any JSON was read: an HTTP error for every verb.
        return (source.status(), message.into_bytes());
    }
    let json = match verb {
        Verb::Filter => serde_json::to_vec(&ExtenderFilterResult {
            error: message.clone(),
            ..Default::default()
        }),
        Verb::Bind => serde_json::to_vec(&ExtenderBindingResult {
            error: message.clone(),
        }),
        Verb::Prioritize | Verb::Preempt => {
            let status = match error {
                ExtenderError::BadRequest { .. } | ExtenderError::MissingPod { .. } => {
                    StatusCode::BAD_REQUEST
                }
                ExtenderError::UnsupportedVerb { .. } => StatusCode::NOT_FOUND,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            return (status, message.into_bytes());
        }
    };
    match json {
        Ok(body) => (StatusCode::OK, body),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, message.into_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_errors_go_in_the_error_field() {
        let (status, body) = error_response(Verb::Filter, &ExtenderError::NotSynced);
        assert_eq!(status, StatusCode::OK);
        let result: ExtenderFilterResult = serde_json::from_slice(&body).expect("json");
        assert!(result.error.contains("not synced"), "{}", result.error);
        assert!(result.node_names.is_none() && result.nodes.is_none());
    }

    #[test]
    fn prioritize_errors_are_http_errors_with_the_chain() {
        let source = serde_json::from_str::<u8>("x").expect_err("bad json");
        let error = ExtenderError::BadRequest {
            verb: Verb::Prioritize,
            reason: super::super::limits::describe_json_error(&source),
        };
        let (status, body) = error_response(Verb::Prioritize, &error);
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let text = String::from_utf8(body).expect("utf8");
        assert!(
            text.starts_with("parse prioritize request body: "),
            "{text}"
        );
    }
}
