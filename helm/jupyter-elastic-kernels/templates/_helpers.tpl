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

{{/* gateway.podLabels, less the selector's keys (the chart's own labels always win). */}}
{{- define "jek.podLabels" -}}
{{- with omit .Values.gateway.podLabels "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{- define "jek.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The kernel image: kernels.image, else the project's kernel image beside the gateway's
(<image.repository>-kernel, the same tag: scripts/images.sh builds and pushes both so). */}}
{{- define "jek.kernelImage" -}}
{{- .Values.kernels.image | default (printf "%s-kernel:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{- define "jek.claimName" -}}
{{- default (printf "%s-checkpoints" (include "jek.fullname" .)) .Values.checkpoints.existingClaim -}}
{{- end -}}

{{/* The master checkpoint secret: its Secret, and where the gateway (only) mounts it. */}}
{{- define "jek.checkpointSecretName" -}}
{{- default (printf "%s-checkpoint-secret" (include "jek.fullname" .)) .Values.checkpointSecret.existingSecret -}}
{{- end -}}
{{- define "jek.checkpointSecretDir" -}}/var/run/secrets/jupyter-elastic/checkpoint{{- end -}}

{{/* The node agents' shared token: its Secret, and where the gateway and the agents mount it. */}}
{{- define "jek.agentTokenSecretName" -}}
{{- default (printf "%s-node-agent-token" (include "jek.fullname" .)) .Values.nodeAgent.tokenSecret -}}
{{- end -}}
{{- define "jek.agentTokenDir" -}}/var/run/secrets/jupyter-elastic/node-agent{{- end -}}

{{/* The Prometheus scrape token's Secret (key "token"): the gateway reads it as ELASTIC_METRICS_TOKEN
(ElasticGateway.metrics_token), the ServiceMonitor sends it as a bearer token. */}}
{{- define "jek.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "jek.fullname" .)) .Values.metrics.tokenSecret -}}
{{- end -}}

{{/* The gateway's ServerApp.base_url ("/", or "/services/<name>/" as a Hub service), from the config it
is given (extraConfig included), for the probes' paths. */}}
{{- define "jek.basePath" -}}
{{- $server := (include "jek.serverConfig" . | fromJson).ServerApp | default dict -}}
{{- $base := index $server "base_url" | default "/" | toString | trimPrefix "/" | trimSuffix "/" -}}
{{- if $base }}/{{ $base }}/{{ else }}/{{ end -}}
{{- end -}}

{{/* Where the gateway serves /metrics: under its ServerApp.base_url (/services/<name>/ as a Hub service),
read from the config it is given, extraConfig included. */}}
{{- define "jek.metricsPath" -}}
{{- $server := (include "jek.serverConfig" . | fromJson).ServerApp | default dict -}}
{{- $base := index $server "base_url" | default "/" | toString | trimPrefix "/" | trimSuffix "/" -}}
{{- if $base }}/{{ $base }}/metrics{{ else }}/metrics{{ end -}}
{{- end -}}

{{/* The value of a Secret the chart makes: the one already in the cluster (kept across upgrades), else
a new random one. Call with (list $ "<secret name>" "<key>"). */}}
{{- define "jek.keptSecretValue" -}}
{{- $root := index . 0 -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (index . 1) -}}
{{- if and $existing (index ($existing.data | default dict) (index . 2)) -}}
{{- index $existing.data (index . 2) -}}
{{- else -}}
{{- randAlphaNum 64 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* The gateway's pods, as a NetworkPolicy peer. */}}
{{- define "jek.gatewayPeer" -}}
namespaceSelector:
  matchLabels:
    kubernetes.io/metadata.name: {{ .Release.Namespace }}
podSelector:
  matchLabels:
    {{- include "jek.selector" . | nindent 4 }}
    app.kubernetes.io/component: gateway
{{- end -}}

{{/* The kernel pods' NetworkPolicies (no namespace): rendered in every kernel namespace of the chart and
passed to the gateway for the namespaces it creates. They select this release's kernel and warm pods
(kernelmgr/kube/labels.py: name, instance, app.kubernetes.io/component), never Enterprise Gateway's. Ingress: the gateway only (the kernel ports carry
code execution, a warm pod's port a key and a checkpoint). Egress: denied but for the gateway, DNS and
networkPolicy.kernels' allow-list; never the cloud metadata service or private ranges unless allowed. */}}
{{- define "jek.kernelNetworkPolicies" -}}
{{- $allow := .Values.networkPolicy.kernels.egressAllowRules -}}
{{- $private := list "10.0.0.0/8" "172.16.0.0/12" "192.168.0.0/16" -}}
{{- $dns := list (dict "port" 53 "protocol" "UDP") (dict "port" 53 "protocol" "TCP") -}}
items:
  - metadata:
      name: {{ include "jek.fullname" . }}-kernel-pods
      labels:
        {{- include "jek.labels" . | nindent 8 }}
    spec:
      podSelector: &kernels
        matchLabels:
          {{- include "jek.selector" . | nindent 10 }}
        matchExpressions:
          - {key: app.kubernetes.io/component, operator: In, values: [kernel, warm-kernel]}
      policyTypes: [Ingress]
      ingress:
        - from:
            - {{- include "jek.gatewayPeer" . | nindent 14 }}
  - metadata:
      name: {{ include "jek.fullname" . }}-kernel-pods-egress
      labels:
        {{- include "jek.labels" . | nindent 8 }}
    spec:
      podSelector: *kernels
      policyTypes: [Egress]
      egress:
        - to:
            - {{- include "jek.gatewayPeer" . | nindent 14 }}
          ports:
            - {port: {{ .Values.gateway.port }}, protocol: TCP}
        {{- if $allow.dnsPortsKubeSystemNamespace }}
        - to:
            - namespaceSelector:
                matchLabels:
                  kubernetes.io/metadata.name: kube-system
          ports: {{ toJson $dns }}
        {{- end }}
        {{- if $allow.dnsPortsPrivateIPs }}
        - to:
            {{- range $private }}
            - ipBlock: {cidr: {{ . }}}
            {{- end }}
            - ipBlock:
                cidr: 169.254.0.0/16
                {{- if not $allow.cloudMetadataServer }}
                except: [169.254.169.254/32]
                {{- end }}
          ports: {{ toJson $dns }}
        {{- end }}
        {{- if $allow.nonPrivateIPs }}
        - to:
            - ipBlock:
                cidr: 0.0.0.0/0
                except: {{ toJson (concat $private (list "169.254.0.0/16")) }}
            - ipBlock:
                cidr: ::/0
                except: [fc00::/7, fe80::/10]
        {{- end }}
        {{- if $allow.privateIPs }}
        - to:
            {{- range $private }}
            - ipBlock: {cidr: {{ . }}}
            {{- end }}
        {{- end }}
        {{- if $allow.cloudMetadataServer }}
        - to:
            - ipBlock: {cidr: 169.254.0.0/16}
        {{- end }}
        {{- with .Values.networkPolicy.kernels.egress }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* The sections of the server's config that change without a restart (and of ElasticKernels, the GPU
sizes): a ConfigMap of their own, mounted as a folder (the kubelet replaces the file when it changes)
and re-read by the gateway (ElasticKernels.live_config_file), outside the checksum that restarts the
gateway. */}}
{{- define "jek.liveSections" -}}CullPolicy ElasticQuota{{- end -}}
{{- define "jek.liveConfigDir" -}}/etc/jupyter-elastic-live{{- end -}}

{{/* The gateway's jupyter_server_config.json: all but the live settings, and where those are. */}}
{{- define "jek.gatewayConfig" -}}
{{- $config := include "jek.serverConfig" . | fromJson -}}
{{- range (include "jek.liveSections" . | splitList " ") }}
{{- $_ := unset $config . -}}
{{- end }}
{{- $elastic := index $config "ElasticKernels" | default dict -}}
{{- $_ := unset $elastic "profiles" -}}
{{- $_ := set $elastic "live_config_file" (printf "%s/live_config.json" (include "jek.liveConfigDir" .)) -}}
{{- $_ := set $config "ElasticKernels" $elastic -}}
{{- toPrettyJson $config -}}
{{- end -}}

{{/* live_config.json: the live settings of the server's config (extraConfig's included). */}}
{{- define "jek.liveConfig" -}}
{{- $config := include "jek.serverConfig" . | fromJson -}}
{{- $live := dict -}}
{{- range (include "jek.liveSections" . | splitList " ") }}
{{- if hasKey $config . }}
{{- $_ := set $live . (index $config .) -}}
{{- end }}
{{- end }}
{{- $elastic := index $config "ElasticKernels" | default dict -}}
{{- if hasKey $elastic "profiles" }}
{{- $_ := set $live "ElasticKernels" (dict "profiles" (index $elastic "profiles")) -}}
{{- end }}
{{- toPrettyJson $live -}}
{{- end -}}

{{- define "jek.serverConfig" -}}
{{- $v := .Values -}}
{{- $elastic := dict
  "profiles" (default (dict "whole" (dict "display_name" "1 GPU" "gpu_fraction" 1 "backend" "whole")) $v.gpu.profiles)
  "gpu_inventory_source" $v.gpu.inventorySource
  "gpu_inventory" $v.gpu.inventory
  "allocation_strategy" $v.gpu.allocationStrategy
  "checkpoint_root" $v.checkpoints.mountPath
  "checkpoint_secret_file" (printf "%s/%s" (include "jek.checkpointSecretDir" .) $v.checkpointSecret.key)
  "kernel_provisioner" "elastic-kubernetes-provisioner" -}}
{{- $provisioner := dict
  "namespace" (include "jek.kernelNamespace" .)
  "state_namespace" .Release.Namespace
  "image" (include "jek.kernelImage" .)
  "run_as_user" $v.kernels.runAsUser
  "user_ids" $v.kernels.userIds
  "node_selector" $v.kernels.nodeSelector
  "tolerations" $v.kernels.tolerations
  "launch_timeout" $v.kernels.launchTimeout
  "first_port" $v.kernels.firstPort
  "stop_grace_seconds" $v.kernels.stopGraceSeconds
  "failed_pod_retention" $v.kernels.failedPodRetention
  "checkpoint_claim" (include "jek.claimName" .)
  "node_agent_port" $v.nodeAgent.port
  "node_agent_instance" .Release.Name
  "instance" .Release.Name
  "cpu_kernel_resources" $v.kernels.cpuResources
  "resources" $v.kernels.resources
  "size_resources" $v.kernels.sizeResources
  "size_pod_settings" $v.kernels.sizePodSettings
  "cpu_pod_settings" $v.kernels.cpuPodSettings
  "shm_size" $v.kernels.shmSize
  "pod_patch" $v.kernels.podPatch
  "validate_pods_at_start" $v.kernels.validatePodsAtStart
  "user_volumes" $v.kernels.userVolumes
  "home_volume" $v.kernels.homeVolume
  "notebook_root" $v.kernels.notebookRoot
  "home_access_mode" $v.kernels.homeAccessMode
  "user_pod_selector" $v.kernels.userPodSelector
  "user_pod_namespace" $v.kernels.userPodNamespace
  "client_env" $v.kernels.clientEnv
  "kernelspec_images" $v.kernels.kernelspecImages
  "kernelspec_argv" $v.kernels.kernelspecArgv
  "warm_pods" $v.kernels.warmPods -}}
{{- if $v.nodeAgent.enabled }}
{{- $_ := set $provisioner "node_agent_token_file" (printf "%s/token" (include "jek.agentTokenDir" .)) -}}
{{- end }}
{{- if $v.networkPolicy.enabled }}
{{- $_ := set $provisioner "namespace_network_policies" (include "jek.kernelNetworkPolicies" . | fromYaml).items -}}
{{- end }}
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
{{- if $v.jupyterhub.userIdsFromAuthState }}
{{- $_ := set $gateway "user_ids_from_auth_state" $v.jupyterhub.userIdsFromAuthState -}}
{{- $_ := set $gateway "user_ids_refresh_seconds" $v.jupyterhub.userIdsRefreshSeconds -}}
{{- end }}
{{- $quota := dict "default" $v.quota.default "groups" $v.quota.groups "users" $v.quota.users -}}
{{- $config := dict
  "ServerApp" $server
  "ElasticKernels" $elastic
  "ElasticKubernetesProvisioner" $provisioner
  "CullPolicy" $cull
  "ElasticGateway" $gateway
  "ElasticQuota" $quota
  "ElasticLeaderElection" (dict "enabled" true "lease_name" (printf "%s-gateway" (include "jek.fullname" .)) "serving_label" "elastic.jupyter.org/serving") -}}
{{- if eq $v.checkpoints.store "s3" }}
{{- $s3 := $v.checkpoints.objectStore -}}
{{- $_ := required "checkpoints.objectStore.endpoint is required with checkpoints.store s3" $s3.endpoint -}}
{{- $_ := required "checkpoints.objectStore.bucket is required with checkpoints.store s3" $s3.bucket -}}
{{- $_ := required "checkpoints.objectStore.existingSecret (the gateway's credential) is required with checkpoints.store s3" $s3.existingSecret -}}
{{- $_ := set $elastic "checkpoint_store" "s3" -}}
{{- /* Kernel pods send their checkpoints to the bucket: no claim in them, an emptyDir as scratch. */ -}}
{{- $_ := set $provisioner "checkpoint_claim" "" -}}
{{- $_ := set $config "S3Checkpoints" (dict
  "endpoint" $s3.endpoint
  "bucket" $s3.bucket
  "region" $s3.region
  "prefix" $s3.prefix
  "access_key_id_env" "ELASTIC_S3_ACCESS_KEY_ID"
  "secret_access_key_env" "ELASTIC_S3_SECRET_ACCESS_KEY"
  "presign_seconds" $s3.presignSeconds
  "part_size_mib" $s3.partSizeMib) -}}
{{- if $s3.encryptionSecret }}
{{- $files := list -}}
{{- range $s3.encryptionKeys }}
{{- $files = append $files (printf "/etc/jupyter-elastic-encryption/%s" .) -}}
{{- end }}
{{- $_ := set (index $config "S3Checkpoints") "encryption_key_files" $files -}}
{{- end }}
{{- else if $v.checkpoints.encryptionSecret }}
{{- /* The file system's checkpoints, encrypted at rest under master keys off the claim. */ -}}
{{- $files := list -}}
{{- range $v.checkpoints.encryptionKeys }}
{{- $files = append $files (printf "/etc/jupyter-elastic-encryption/%s" .) -}}
{{- end }}
{{- $_ := set $elastic "checkpoint_encryption_key_files" $files -}}
{{- end }}
{{- mustMergeOverwrite $config (deepCopy $v.extraConfig) | toPrettyJson -}}
{{- end -}}

{{/* The Secret of the master keys checkpoints are encrypted under (the store's), or "". */}}
{{- define "jek.encryptionSecret" -}}
{{- if eq .Values.checkpoints.store "s3" -}}
{{- .Values.checkpoints.objectStore.encryptionSecret -}}
{{- else -}}
{{- .Values.checkpoints.encryptionSecret -}}
{{- end -}}
{{- end -}}
