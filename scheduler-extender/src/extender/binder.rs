//! The API side of bind: record the assignment on the pod once, then create the Binding.

use std::future::Future;
use std::pin::Pin;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};

use super::error::ExtenderError;
use vgpu_core::resources::ANNOTATION_ASSIGNMENT;

/// What bind must write for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindPlan {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID (a precondition of both writes).
    pub uid: String,
    /// Target node.
    pub node: String,
    /// The assignment record (`vgpu.io/assignment`), JSON.
    pub assignment_json: String,
    /// The watch already shows the pod bound to `node` with this record: nothing to write.
    pub already_bound: bool,
}

impl BindPlan {
    /// `namespace/name`.
    #[must_use]
    pub fn pod_key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A boxed future, so that [`Binder`] can be used as a trait object.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Carries out a [`BindPlan`] against the API server.
pub trait Binder: Send + Sync + std::fmt::Debug {
    /// Writes the assignment annotation once, then creates the Binding.
    fn bind<'a>(&'a self, plan: &'a BindPlan) -> BoxFuture<'a, Result<(), ExtenderError>>;
}

/// The real binder: two API calls through kube-rs.
#[derive(Clone)]
pub struct KubeBinder {
    client: Client,
}

impl std::fmt::Debug for KubeBinder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBinder").finish_non_exhaustive()
    }
}

impl KubeBinder {
    /// A binder using this client.
    #[must_use]
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

/// The merge patch that records the assignment. It carries the pod's UID, which
/// the API server treats as a precondition: a pod recreated under the same name
/// is never annotated with another pod's GPUs.
#[must_use]
pub fn assignment_patch(plan: &BindPlan) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "uid": plan.uid,
            "annotations": { ANNOTATION_ASSIGNMENT: plan.assignment_json },
        }
    })
}

/// The Binding object for the `pods/binding` subresource (UID-preconditioned,
/// as kube-scheduler's own binder does).
#[must_use]
pub fn binding_object(plan: &BindPlan) -> Binding {
    Binding {
        metadata: ObjectMeta {
            name: Some(plan.name.clone()),
            namespace: Some(plan.namespace.clone()),
            uid: Some(plan.uid.clone()),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(plan.node.clone()),
            ..ObjectReference::default()
        },
    }
}

impl Binder for KubeBinder {
    fn bind<'a>(&'a self, plan: &'a BindPlan) -> BoxFuture<'a, Result<(), ExtenderError>> {
        Box::pin(async move {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &plan.namespace);
            pods.patch(
                &plan.name,
                &PatchParams::default(),
                &Patch::Merge(assignment_patch(plan)),
            )
            .await
            .map_err(|source| ExtenderError::Annotate {
                pod: plan.pod_key(),
                source,
            })?;
            pods.create_subresource::<Binding, serde_json::Value>(
                "binding",
                &plan.name,
                &PostParams::default(),
                &binding_object(plan),
            )
            .await
            .map_err(|source| ExtenderError::Binding {
                pod: plan.pod_key(),
                node: plan.node.clone(),
                source,
            })?;
            Ok(())
        })
    }
}

/// A binder that makes no API call: for measuring bind without the round trip,
/// and for HTTP tests that have no API server.
#[derive(Debug, Default)]
pub struct NoopBinder;

impl Binder for NoopBinder {
    fn bind<'a>(&'a self, _plan: &'a BindPlan) -> BoxFuture<'a, Result<(), ExtenderError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Whether a failed bind may nevertheless have taken effect on the API server.
///
/// A failed annotation write never has: without the Binding the pod is on no
/// node, and a record on an unbound pod is not counted. A failed Binding may
/// have, when the answer is a server error or a transport failure (the write
/// may have landed), or a 409 Conflict (kube-rs retries 503/504 on its own, so
/// a 409 can be the answer to the retry of our own landed write). Such a bind's
/// assumption is kept until the watch shows the truth or its TTL ends, instead
/// of being released at once, so that its GPUs are never handed to another pod
/// while they may be in use.
#[must_use]
pub fn outcome_uncertain(error: &ExtenderError) -> bool {
    let ExtenderError::Binding { source, .. } = error else {
        return false;
    };
    match source {
        kube::Error::Api(status) => status.code >= 500 || status.code == 409,
        kube::Error::SerdeError(_) => false,
        _ => true,
    }
}
