{{/* Names and labels. */}}
{{- define "octavo.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "octavo.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "octavo.labels" -}}
{{ include "octavo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
octavo.dev/platform: {{ .Values.platform }}
{{- end -}}

{{- define "octavo.servedModelName" -}}
{{- .Values.model.servedModelName | default .Release.Name -}}
{{- end -}}

{{/* The image: each platform has its own (cuda for nvidia, rocm for amd). */}}
{{- define "octavo.image" -}}
{{- $platforms := dict "cpu" "cpu" "nvidia" "cuda" "amd" "rocm" "tpu" "tpu" -}}
{{- $imagePlatform := get $platforms .Values.platform -}}
{{- if not $imagePlatform -}}
{{- fail (printf "platform must be one of cpu, nvidia, amd, tpu; got %q" .Values.platform) -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $imagePlatform)) -}}
{{- end -}}

{{/* Seconds from the kill signal to SIGKILL: preStop, then the drain, then a margin. */}}
{{- define "octavo.terminationGrace" -}}
{{- add .Values.preStopSleepSeconds (ceil .Values.server.shutdownTimeoutSeconds) .Values.terminationGraceMarginSeconds -}}
{{- end -}}

{{- define "octavo.checks" -}}
{{- if .Values.disaggregation.enabled -}}
{{- fail "disaggregation.enabled: prefill/decode roles need KV connectors, which octavo does not have yet (issue 61); leave it false" -}}
{{- end -}}
{{- if and .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled -}}
{{- fail "autoscaling: enable hpa or keda, not both (KEDA makes its own HPA)" -}}
{{- end -}}
{{- if ne (mod (int .Values.parallel.tensorParallelSize) (int .Values.parallel.nnodes)) 0 -}}
{{- fail (printf "parallel.tensorParallelSize (%v) must be a multiple of parallel.nnodes (%v)" .Values.parallel.tensorParallelSize .Values.parallel.nnodes) -}}
{{- end -}}
{{- if ne .Values.server.metricsNaming "vllm" -}}
{{- if or .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled .Values.metrics.prometheusRule.enabled .Values.metrics.dashboard.enabled -}}
{{- fail "server.metricsNaming: the autoscalers, alerts and dashboard read vLLM's metric names; set it to vllm" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Accelerators a pod asks for, by platform: one per rank on its node. */}}
{{- define "octavo.acceleratorResources" -}}
{{- $ranks := div (int .Values.parallel.tensorParallelSize) (int .Values.parallel.nnodes) -}}
{{- $names := dict "nvidia" "nvidia.com/gpu" "amd" "amd.com/gpu" "tpu" "google.com/tpu" -}}
{{- $name := get $names .Values.platform -}}
{{- if $name }}
{{ $name }}: {{ $ranks }}
{{- end -}}
{{- end -}}

{{/*
The pod spec: role "server" (one node), "leader" (node 0 of a LeaderWorkerSet: the API) or
"worker" (its other nodes: ranks only, no server).
*/}}
{{- define "octavo.podSpec" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $role := .role -}}
{{- $serves := ne $role "worker" -}}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
hostIPC: {{ $v.hostIPC }}
{{- if $v.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
terminationGracePeriodSeconds: {{ include "octavo.terminationGrace" $root }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: octavo
    image: {{ include "octavo.image" $root }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    args:
      - serve
      - {{ $v.model.path | quote }}
      - --host
      - "0.0.0.0"
      - --port
      - {{ $v.server.port | quote }}
      - --served-model-name
      - {{ include "octavo.servedModelName" $root | quote }}
      - --metrics-naming
      - {{ $v.server.metricsNaming }}
      - --shutdown-timeout
      - {{ $v.server.shutdownTimeoutSeconds | quote }}
      - --ready-timeout
      - {{ $v.server.readyTimeoutSeconds | quote }}
      - --tensor-parallel-size
      - {{ $v.parallel.tensorParallelSize | quote }}
      {{- if $v.model.tokenizer }}
      - --tokenizer
      - {{ $v.model.tokenizer | quote }}
      {{- end }}
      {{- if not (kindIs "invalid" $v.server.maxQueueLen) }}
      - --max-queue-len
      - {{ $v.server.maxQueueLen | quote }}
      {{- end }}
      {{- if gt (int $v.parallel.nnodes) 1 }}
      - --nnodes
      - {{ $v.parallel.nnodes | quote }}
      - --node-rank
      - {{ if eq $role "leader" }}"0"{{ else }}$(LWS_WORKER_INDEX){{ end }}
      - --master-addr
      - $(LWS_LEADER_ADDRESS)
      - --master-port
      - {{ $v.parallel.masterPort | quote }}
      {{- end }}
      {{- range $v.server.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    {{- if or $v.apiKey.existingSecret $v.server.env }}
    env:
      {{- if $v.apiKey.existingSecret }}
      - name: OCTAVO_API_KEY
        valueFrom:
          secretKeyRef:
            name: {{ $v.apiKey.existingSecret }}
            key: {{ $v.apiKey.secretKey }}
      {{- end }}
      {{- with $v.server.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- end }}
    {{- if or $serves (eq $role "leader") }}
    ports:
      - name: http
        containerPort: {{ $v.server.port }}
        protocol: TCP
      {{- if eq $role "leader" }}
      - name: rendezvous
        containerPort: {{ $v.parallel.masterPort }}
        protocol: TCP
      {{- end }}
    {{- end }}
    {{- if $serves }}
    startupProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: {{ $v.probes.periodSeconds }}
      failureThreshold: {{ div (add $v.probes.loadTimeoutSeconds $v.probes.periodSeconds -1) $v.probes.periodSeconds }}
    readinessProbe:
      httpGet:
        path: /health/ready
        port: http
      periodSeconds: {{ $v.probes.periodSeconds }}
      timeoutSeconds: {{ add (ceil $v.server.readyTimeoutSeconds) 5 }}
      failureThreshold: {{ $v.probes.readiness.failureThreshold }}
    livenessProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: {{ $v.probes.periodSeconds }}
      timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
      failureThreshold: {{ $v.probes.liveness.failureThreshold }}
    {{- end }}
    lifecycle:
      preStop:
        exec:
          command: ["sleep", {{ $v.preStopSleepSeconds | quote }}]
    resources:
      requests:
        {{- with $v.resources.requests }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- include "octavo.acceleratorResources" $root | nindent 8 }}
      limits:
        {{- with $v.resources.limits }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- include "octavo.acceleratorResources" $root | nindent 8 }}
    securityContext:
      {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - name: model-cache
        mountPath: {{ $v.modelCache.mountPath }}
      - name: dshm
        mountPath: /dev/shm
      - name: home-cache
        mountPath: /home/octavo/.cache
volumes:
  - name: model-cache
    persistentVolumeClaim:
      claimName: {{ $v.modelCache.existingClaim | default (printf "%s-model-cache" (include "octavo.fullname" $root)) }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.shm.sizeLimit }}
  - name: home-cache
    emptyDir: {}
{{- end -}}

{{/* The autoscaling signals, in PromQL over vLLM's names (one place for KEDA and alerts). */}}
{{- define "octavo.matchers" -}}
model_name="{{ include "octavo.servedModelName" . }}"
{{- end -}}
{{- define "octavo.queueQuery" -}}
sum(vllm:num_requests_waiting{ {{- include "octavo.matchers" . -}} })
{{- end -}}
{{- define "octavo.preemptionRateQuery" -}}
sum(rate(vllm:num_preemptions_total{ {{- include "octavo.matchers" . -}} }[2m]))
{{- end -}}
{{- define "octavo.scaleTarget" -}}
{{- if gt (int .Values.parallel.nnodes) 1 -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "octavo.fullname" . }}
{{- end -}}
