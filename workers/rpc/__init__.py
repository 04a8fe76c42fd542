"""gRPC server plumbing shared by every speedpipe server (each stage's StageService, the serving
GenerateService): authentication (`control_auth`), parsing requests (`request_parse`) and the rich
error details of a failed call (`status_details`). Knows no RPC: the servicers do."""
