{{/* Name prefix of every object. */}}
{{- define "jek.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Namespace the kernels run in (the release's unless set). */}}
{{- define "jek.kernelNamespace" -}}
{{- default .Release.Namespace .Values.kernels.namespace -}}
{{- end -}}

{{/* Every kernel namespace that gets a RoleBinding from the chart. */}}
{{- define "jek.kernelNamespaces" -}}
{{- $all := list (include "jek.kernelNamespace" .) -}}
{{- range .Values.kernels.extraNamespaces }}{{- $all = append $all . -}}{{- end -}}
{{- $all | uniq | toJson -}}
{{- end -}}

{{- define "jek.labels" -}}
app.kubernetes.io/name: jupyter-elastic-kernels
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "jek.selector" -}}
app.kubernetes.io/name: jupyter-elastic-kernels
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "jek.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "jek.claimName" -}}
{{- default (printf "%s-checkpoints" (include "jek.fullname" .)) .Values.checkpoints.existingClaim -}}
{{- end -}}

{{/* jupyter_server_config.json, built from the values (extraConfig merged over it). */}}
{{- define "jek.serverConfig" -}}
{{- $v := .Values -}}
{{- $elastic := dict
  "profiles" $v.gpu.profiles
  "gpu_inventory_source" $v.gpu.inventorySource
  "gpu_inventory" $v.gpu.inventory
  "allocation_strategy" $v.gpu.allocationStrategy
  "checkpoint_root" $v.checkpoints.mountPath
  "kernel_provisioner" "elastic-kubernetes-provisioner" -}}
{{- $provisioner := dict
  "namespace" (include "jek.kernelNamespace" .)
  "image" $v.kernels.image
  "run_as_user" $v.kernels.runAsUser
  "node_selector" $v.kernels.nodeSelector
  "tolerations" $v.kernels.tolerations
  "launch_timeout" $v.kernels.launchTimeout
  "first_port" $v.kernels.firstPort
  "stop_grace_seconds" $v.kernels.stopGraceSeconds
  "checkpoint_claim" (include "jek.claimName" .)
  "node_agent_port" $v.nodeAgent.port
  "warm_pods" $v.kernels.warmPods -}}
{{- if $v.kernels.namespaceTemplate }}
{{- $_ := set $provisioner "namespace_template" $v.kernels.namespaceTemplate -}}
{{- $_ := set $provisioner "create_namespace" $v.kernels.createNamespaces -}}
{{- $_ := set $provisioner "namespace_cluster_role" (printf "%s:kernel-pods" (include "jek.fullname" .)) -}}
{{- end }}
{{- $cull := dict
  "idle_timeout" $v.cull.idleTimeout
  "interval" $v.cull.interval
  "warn_before" $v.cull.warnBefore
  "hibernated_ttl" $v.cull.hibernatedTtl
  "rules" $v.cull.rules -}}
{{- /* root_dir names the kernel registry on the claim (kernels-<identity of root_dir>.json): a fixed one, so
a new gateway pod (upgrade, another image's working directory) finds the hibernated kernels. The gateway
serves no files, so the claim's folder is as good a root as any. */ -}}
{{- $server := dict "ip" "0.0.0.0" "port" $v.gateway.port "allow_root" false "root_dir" $v.checkpoints.mountPath -}}
{{- if eq $v.gateway.auth "jupyterhub" }}
{{- /* A Hub service is served under /services/<name>/ (through the Hub's proxy or directly). */ -}}
{{- $_ := set $server "base_url" (printf "/services/%s/" $v.jupyterhub.serviceName) -}}
{{- end }}
{{- $gateway := dict "auth" $v.gateway.auth "admin_users" $v.gateway.adminUsers "admin_groups" $v.gateway.adminGroups -}}
{{- $quota := dict "default" $v.quota.default "groups" $v.quota.groups "users" $v.quota.users -}}
{{- $config := dict
  "ServerApp" $server
  "ElasticKernels" $elastic
  "ElasticKubernetesProvisioner" $provisioner
  "CullPolicy" $cull
  "ElasticGateway" $gateway
  "ElasticQuota" $quota -}}
{{- mustMergeOverwrite $config (deepCopy $v.extraConfig) | toPrettyJson -}}
{{- end -}}
