{{/* Labels every object of the release carries. */}}
{{- define "pdmesh.labels" -}}
app.kubernetes.io/name: pdmesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The pods of one kind: name, instance and component. */}}
{{- define "pdmesh.selector" -}}
app.kubernetes.io/name: pdmesh
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .kind }}
{{- end -}}

{{- define "pdmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The environment every pdmesh container shares. */}}
{{- define "pdmesh.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PDMESH_CACHE_DIR
  value: /cache
- name: PDMESH_DRAIN_TIMEOUT_S
  value: {{ .Values.drain.timeoutS | quote }}
- name: PDMESH_DRAIN_NOTICE_MS
  value: {{ .Values.drain.noticeMs | quote }}
- name: CONSUL_HTTP_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.consul.tokenSecret }}
      key: token
      optional: true
{{- end -}}

{{/* Where every service finds the others: the Consul agent on its node. */}}
{{- define "pdmesh.discovery" -}}
--discovery=consul://$(HOST_IP):{{ .Values.consul.port }}
{{- end -}}
